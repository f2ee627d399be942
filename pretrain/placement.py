"""Pipeline placement: which decoder layers, embedding, loss and MTP layers each model chunk holds.

Three ways to place layers beyond Megatron-Core's even split, all Megatron-Core's own options:

- `parallel.pipeline_layout`: Megatron-Core's `pipeline_model_parallel_layout` string, one `|`-separated stage
  per virtual pipeline stage in order (stage s is virtual stage s // PP of pipeline rank s % PP), each holding
  `E` (embedding), `t` (decoder layer), `m` (MTP layer) and `L` (loss); `(...)*n` and `x*n` repeat, commas are
  cosmetic. E.g. DeepSeek-V3 on PP8 × VP2: `Et*4|(t*4|)*14tmL`.
- `parallel.account_for_embedding_in_pipeline_split` / `..._loss_...`: the embedding (loss) counts as one layer in
  the even split, so the first (last) chunk holds one decoder layer fewer. E.g. Llama-3.1-405B's 126 layers + 2
  on PP8 × VP8.
- `parallel.num_layers_in_first/last_pipeline_stage` (pretrain.layout.chunk_layer_range).

The string is parsed and checked by Megatron-Core's `PipelineParallelLayerLayout` (the class `TransformerConfig`
builds from it), so a layout `validate` accepts is one Megatron-Core builds. Pure functions; torch is imported
only when a layout string is parsed.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

# Megatron-Core's LayerType names for the layout characters (its `parse_str_to_list` table).
EMBEDDING, DECODER, MTP, LOSS = "embedding", "decoder", "mtp", "loss"


class PlacementError(ValueError):
    """The pipeline layout is refused: our one-line reason, then Megatron-Core's own words where it refused it."""


# Megatron-Core's layout grammar (`PipelineParallelLayerLayout.parse_str_to_list`, 0.16.1-0.19): commas are dropped,
# then every `(...)*n` is unrolled (one pass, innermost parentheses), then every `x*n`; the result is split at `|`.
_GROUP_REPEAT = re.compile(r"\(([^)]+)\)\*(\d+)")
_CHAR_REPEAT = re.compile(r"(.)\*(\d+)")
_LAYER_CHARS = {"E": EMBEDDING, "t": DECODER, "m": MTP, "L": LOSS}
_MAX_REPEAT_DIGITS = 18  # a repeat count beyond 10^18 expands past any bound


def shown(layout: str, width: int = 60) -> str:
    """`layout` quoted for a message, cut to `width` characters (a layout string may be any length)."""
    return repr(layout) if len(layout) <= width else f"{layout[:width]!r}... ({len(layout):,} characters)"


def expansion_bound(pp: int, num_layers: int, mtp_num_layers: int | None) -> int:
    """The most characters a layout of this model can unroll to: its E, t, m and L, and a `|` before each of at
    most PP × that many stages (a stage holds at least one of them, or is one of a few empty ones)."""
    layers = num_layers + (mtp_num_layers or 0) + 2
    return layers + pp * layers


def _unrolled_length(text: str, pattern: re.Pattern, bound: int) -> int:
    """The length `pattern`'s unrolling of `text` would have, computed without unrolling (bound + 1 when above)."""
    total = len(text)
    for match in pattern.finditer(text):
        digits = match.group(2).lstrip("0") or "0"
        if len(digits) > _MAX_REPEAT_DIGITS:
            return bound + 1
        total += len(match.group(1)) * int(digits) - len(match.group(0))
    return total if total <= bound else bound + 1


def expand_layout(layout: str, bound: int) -> str | None:
    """`layout` unrolled as Megatron-Core unrolls it; None, before anything is unrolled, where that would exceed
    `bound` characters (so that no layout string costs more than the model's size to check)."""
    text = layout.replace(",", "")
    for pattern in (_GROUP_REPEAT, _CHAR_REPEAT):
        if _unrolled_length(text, pattern, bound) > bound:
            return None
        text = pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)
    return text


def _own_reason(stages: list[str], pp: int, num_layers: int, mtp_num_layers: int | None) -> str:
    """What the unrolled layout has that the model and parallel.pipeline do not allow, in our words."""
    bad = sorted({c for stage in stages for c in stage if c not in _LAYER_CHARS})
    flat = "".join(stages)
    counts = {c: flat.count(c) for c in _LAYER_CHARS}
    mtp = mtp_num_layers or 0
    if bad:
        return f"has the character(s) {', '.join(map(repr, bad))}: a stage holds only E, t, m and L"
    if len(stages) % pp:
        return f"has {len(stages)} stage(s), not a multiple of parallel.pipeline={pp}"
    for char, name, where, placed in (("E", "embedding", "first", flat.startswith("E")),
                                      ("L", "loss", "last", flat.endswith("L"))):
        if counts[char] != 1 or not placed:
            return f"must hold one {name} `{char}`, {where} (it has {counts[char]}{'' if placed else f', not {where}'})"
    if counts["t"] != num_layers:
        return f"places {counts['t']} decoder layer(s) `t`, but model.num_layers={num_layers}"
    if counts["m"] != mtp:
        return f"places {counts['m']} MTP layer(s) `m`, but model.mtp_num_layers={mtp_num_layers}"
    return "places the MTP layers where Megatron-Core does not allow them"


def _megatron_words(exc: BaseException, width: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= width else text[:width] + "..."


@lru_cache(maxsize=64)
def parse_layout(layout: str, pp: int) -> Any:
    """Megatron-Core's `PipelineParallelLayerLayout` of `layout` on `pp` pipeline ranks (format checks only). Only
    for a layout `check_layout` accepted (whose unrolling it bounded)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    return PipelineParallelLayerLayout(layout, pp)


_MEGATRON_REFUSALS = (AssertionError, ValueError, KeyError, TypeError, IndexError, NotImplementedError)


def check_layout(layout: str, pp: int, num_layers: int, mtp_num_layers: int | None) -> tuple[int, bool]:
    """(virtual pipeline size, MTP standalone) of a layout Megatron-Core accepts for this model; PlacementError
    otherwise: the layout empty, unrolling past what the model can have (checked before Megatron-Core unrolls it in
    memory), or our reason and Megatron-Core's words. Runs `validate_layer_layout`, what `TransformerConfig` runs."""
    if not layout.replace(",", "").strip():
        raise PlacementError("is empty")
    bound = expansion_bound(pp, num_layers, mtp_num_layers)
    expanded = expand_layout(layout, bound)
    if expanded is None:
        raise PlacementError(f"unrolls to more than {bound:,} characters, more than any layout of model.num_layers="
                             f"{num_layers}{f' + {mtp_num_layers} MTP' if mtp_num_layers else ''} on parallel.pipeline="
                             f"{pp} has (Megatron-Core would unroll it in memory)")
    stages = expanded.split("|")
    try:
        parsed = parse_layout(layout, pp)
        standalone = parsed.validate_layer_layout(num_layers=num_layers, mtp_num_layers=mtp_num_layers or None)
    except _MEGATRON_REFUSALS as e:
        raise PlacementError(f"{_own_reason(stages, pp, num_layers, mtp_num_layers)} (Megatron-Core: "
                             f"\"{_megatron_words(e)}\")") from None
    return parsed.virtual_pipeline_model_parallel_size, bool(standalone)


def _names(parsed: Any, pp_rank: int, vp_stage: int) -> list[str]:
    return [t.name for t in parsed.layout[pp_rank][vp_stage]]


def layout_chunk_range(layout: str, pp: int, pp_rank: int, vp_stage: int, kind: str = DECODER) -> tuple[int, int]:
    """(offset, count) of the `kind` layers of chunk (pp_rank, vp_stage): the layers of every earlier virtual
    stage, and of earlier ranks in this one, come first (Megatron-Core's `get_layer_offset`, with explicit ranks)."""
    parsed = parse_layout(layout, pp)
    offset = sum(_names(parsed, r, v).count(kind) for v in range(vp_stage + 1)
                 for r in range(pp if v < vp_stage else pp_rank))
    return offset, _names(parsed, pp_rank, vp_stage).count(kind)


def split_chunk_range(num_layers: int, pp: int, vp: int, pp_rank: int, vp_stage: int, embedding: bool,
                      loss: bool) -> tuple[int, int]:
    """(offset, count) of decoder layers with the embedding and/or loss counted as a layer of the even split
    (Megatron-Core's `account_for_*_in_pipeline_split`: the first / last chunk builds one decoder layer fewer)."""
    total = num_layers + embedding + loss
    per_chunk = total // pp // vp
    first = pp_rank == 0 and vp_stage == 0
    last = pp_rank == pp - 1 and vp_stage == vp - 1
    offset = (vp_stage * pp + pp_rank) * per_chunk - (embedding and not first)
    return offset, per_chunk - (embedding and first) - (loss and last)


def mtp_chunk(layout: str | None, pp: int, vp: int) -> tuple[int, int]:
    """(pp_rank, vp_stage) of the chunk holding the MTP layers: the layout's `m`, else the last chunk."""
    if layout is None:
        return pp - 1, vp - 1
    parsed = parse_layout(layout, pp)
    for r in range(pp):
        for v in range(vp):
            if MTP in _names(parsed, r, v):
                return r, v
    return pp - 1, vp - 1


def placement_table(lay: Any, num_layers: int, mtp_num_layers: int | None) -> str:
    """The per-stage placement of `lay` (a `pretrain.layout.Layout`), as Megatron-Core prints a layout
    (`PipelineParallelLayerLayout.pretty_repr`: one row per pipeline rank, one column per virtual stage)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    stages = []
    mtp_at = lay.mtp_chunk if mtp_num_layers else None
    for v in range(lay.vp):
        for r in range(lay.pp):
            stage = [EMBEDDING] if (r, v) == (0, 0) else []
            stage += [DECODER] * lay.chunk_layers(num_layers, r, v)[1]
            stage += [MTP] * (mtp_num_layers or 0) if (r, v) == mtp_at else []
            stage += [LOSS] if (r, v) == (lay.pp - 1, lay.vp - 1) else []
            stages.append(stage)
    return PipelineParallelLayerLayout(stages, lay.pp).pretty_repr()


def placement_lines(lay: Any, num_layers: int, mtp_num_layers: int | None) -> list[str]:
    """What `validate` prints of a run whose placement is not Megatron-Core's even split (else nothing)."""
    if lay.pipeline_layout is None and not (lay.embedding_in_split or lay.loss_in_split) and \
            lay.first_stage_layers is None and lay.last_stage_layers is None:
        return []
    return ["pipeline placement (pipeline rank × virtual stage):", *placement_table(lay, num_layers,
                                                                                     mtp_num_layers).splitlines()]
