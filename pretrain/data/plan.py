"""The data path's input, resolved once: `DataPlan` (`pretrain.run_plan.RunPlan.data`), before validation.

    data = data_plan(cfg)   # mock or blends (parsed here, once), split, seed, sequence length, cache directory

Rules owned here (the data check reports them, the datasets read the result; none parses again):
- `uses_mock`: synthetic tokens only when asked *and* no blend is given — a blend wins over `data.mock: true`,
  as Megatron-LM trains on `--data-path` and uses mock data only without one.
- `parse_blend`: `[prefix, ...]` or `[weight, prefix, ...]` with finite positive weights (numbers or numeric
  strings: YAML 1.1 reads `1e300` as a string), none a negligible share of their sum.
- the index-cache directory: data.cache_dir, else run.dir/data_cache.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

from pretrain.config_parse import shown

BLEND_KEYS = ("data.blend", "data.train_blend", "data.valid_blend", "data.test_blend")
BLEND_FIX = ("write [prefix, ...] or [weight, prefix, weight, prefix, ...] with weights > 0, e.g. "
             "data.blend=[0.7,/d/a_text_document,0.3,/d/b_text_document]")


def uses_mock(d: Any) -> bool:
    """True when the run trains on synthetic tokens: `data.mock` and no blend."""
    return bool(d.mock) and not (d.blend or d.train_blend)


# A weight written as `1e300` or `4.2e9` is a string in YAML 1.1 (PyYAML needs `1.0e+300`): read as a number.
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?|[-+]?(inf|infinity|nan)", re.IGNORECASE)
# A weight whose share of the total is below this would never be drawn (Megatron-Core sizes every dataset of a
# blend by its share of the samples): refused as a mistake rather than trained as an empty entry.
MIN_WEIGHT_SHARE = 1e-12
# Megatron-Core's BlendedDataset holds which dataset each sample comes from as int16 (`dataset_index`, built by its
# C++ helpers with a cast): a blend of more datasets would draw the wrong ones.
MAX_BLEND_DATASETS = 2**15


def _weight(x) -> float | None:
    """A blend weight: a number, or a string YAML 1.1 left unparsed (`1e300`); None for anything else."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str) and _NUMBER.fullmatch(x.strip()):
        return float(x)
    return None


def _share(w: float, total: float) -> str:
    """`w / total` in scientific notation, also where the quotient underflows (1e-300 of 1e300: 1e-600)."""
    if w / total > 0:
        return f"{w / total:.3g}"
    exponent = math.log10(w) - math.log10(total)
    power = math.floor(exponent)
    mantissa = round(10 ** (exponent - power), 2)
    if mantissa >= 10:
        mantissa, power = mantissa / 10, power + 1
    return f"{mantissa:.3g}e{power}"


def parse_blend(items: list) -> tuple[list[str], list[float] | None]:
    """`[prefix, ...]` -> (prefixes, None); `[w, prefix, w, prefix, ...]` -> (prefixes, weights).

    Weights are numbers or numeric strings (`1e300`: YAML 1.1 reads it as a string), each finite and positive
    (Megatron-Core's `BlendedDataset` asserts every weight > 0: a dataset to leave out is removed from the list,
    not given weight 0), with a finite sum and each at least `MIN_WEIGHT_SHARE` of it.
    Raises ValueError with the reason (the caller names the key).
    """
    if not items:
        raise ValueError("is empty")
    prefixes, weights = _parse_blend(items)
    if len(prefixes) > MAX_BLEND_DATASETS:
        raise ValueError(f"names {len(prefixes):,} datasets: Megatron-Core's blend indexes its datasets as int16, at "
                         f"most {MAX_BLEND_DATASETS:,} (merge small ones with `python -m data_tools merge`)")
    return prefixes, weights


def _parse_blend(items: list) -> tuple[list[str], list[float] | None]:
    weighted = len(items) % 2 == 0 and all(_weight(w) is not None for w in items[0::2])
    if all(isinstance(x, str) for x in items) and not weighted:
        return [str(x) for x in items], None
    if _weight(items[0]) is None:
        raise ValueError(f"mixes prefixes and numbers ({shown(items)}); use [prefix, ...] or [weight, prefix, ...]")
    if len(items) % 2 != 0:
        raise ValueError(f"alternates weight, prefix but has an odd number of items ({len(items)})")
    prefixes, weights = items[1::2], [_weight(w) for w in items[0::2]]
    for w, raw, p in zip(weights, items[0::2], prefixes):
        if w is None or not isinstance(p, str) or _weight(p) is not None:
            raise ValueError(f"must alternate weight, prefix; got {raw!r}, {p!r}")
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weight {raw} of {p} is negative or not finite")
        if w == 0:
            raise ValueError(f"weight {raw} of {p} is 0: every weight must be positive (Megatron-Core's blend "
                             "asserts it); remove the entry to leave that dataset out")
    total = math.fsum(weights)
    if not math.isfinite(total):
        raise ValueError(f"weights sum to {total} (too large to normalise); use weights of comparable size, "
                         "e.g. shares that add up to 1")
    for w, raw, p in zip(weights, items[0::2], prefixes):
        if w / total < MIN_WEIGHT_SHARE:
            raise ValueError(f"weight {raw} of {p} is {_share(w, total)} of the total: that dataset would never be "
                             f"drawn (a share below {MIN_WEIGHT_SHARE:g}); use weights of comparable size, or remove "
                             "the entry")
    return list(prefixes), weights


def eval_is_on(t: Any) -> bool:
    """The trainer reads the validation split (train section `t`): evaluation runs at least once."""
    return bool(t.eval_interval) and t.eval_interval >= 1 and t.steps // t.eval_interval > 0


@dataclass(frozen=True)
class DataPlan:
    """Where the tokens come from and what the dataset builder reads: mock data or blends (per key, parsed
    once; their syntax problems kept for validation to report), split, seed, sequence length, Megatron's
    index-cache directory, and the data section itself (document options, tokenizer files, workers)."""

    mock: bool
    blends: dict  # "data.blend" / "data.train_blend" / ... -> (prefixes, weights or None); empty for mock data
    split: str
    cache_dir: str
    config: Any = None  # the data section (pretrain.config.DataConfig)
    seed: int = 0  # train.seed: Megatron's sample order
    seq_length: int = 0  # model.seq_length
    eval_on: bool = False  # the validation split is read (train.eval_interval: evaluation runs at least once)
    blend_problems: tuple = ()  # (key, message, fix) of each blend that does not parse


def data_plan(cfg: Any) -> DataPlan:
    """The `DataPlan` of a config tree (reads its data section, run.dir, train.seed and model.seq_length)."""
    d = cfg.data
    blends, problems = {}, []
    for key in BLEND_KEYS:
        items = getattr(d, key.split(".")[1])
        if not items:
            continue
        try:
            blends[key] = parse_blend(items)
        except ValueError as e:
            problems.append((key, f"{key} {e}", BLEND_FIX))
    mock = uses_mock(d)
    return DataPlan(mock=mock, blends={} if mock else blends, split=d.split,
                    cache_dir=d.cache_dir or os.path.join(cfg.run.dir, "data_cache"), config=d,
                    seed=cfg.train.seed, seq_length=cfg.model.seq_length, eval_on=eval_is_on(cfg.train),
                    blend_problems=tuple(problems))
