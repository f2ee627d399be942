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

from functools import lru_cache
from typing import Any

# Megatron-Core's LayerType names for the layout characters (its `parse_str_to_list` table).
EMBEDDING, DECODER, MTP, LOSS = "embedding", "decoder", "mtp", "loss"


class PlacementError(ValueError):
    """Megatron-Core refuses the pipeline layout (its own assertion message)."""


@lru_cache(maxsize=64)
def parse_layout(layout: str, pp: int) -> Any:
    """Megatron-Core's `PipelineParallelLayerLayout` of `layout` on `pp` pipeline ranks (format checks only)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    try:
        return PipelineParallelLayerLayout(layout, pp)
    except (AssertionError, ValueError, KeyError, TypeError) as e:
        raise PlacementError(str(e) or type(e).__name__) from None


def check_layout(layout: str, pp: int, num_layers: int, mtp_num_layers: int | None) -> tuple[int, bool]:
    """(virtual pipeline size, MTP standalone) of a layout Megatron-Core accepts for this model; PlacementError
    (Megatron-Core's message) otherwise. Runs `validate_layer_layout`, what `TransformerConfig` runs."""
    parsed = parse_layout(layout, pp)
    try:
        standalone = parsed.validate_layer_layout(num_layers=num_layers, mtp_num_layers=mtp_num_layers or None)
    except (AssertionError, ValueError, NotImplementedError) as e:
        raise PlacementError(str(e) or type(e).__name__) from None
    return parsed.virtual_pipeline_model_parallel_size, bool(standalone)


def layout_stage_count(layout: str) -> int:
    """How many (virtual) stages a layout string has: PP × VP."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    return PipelineParallelLayerLayout.get_num_stages_from_str(layout)


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
