"""The range of every numeric setting, read from its declaration (`knob(range=...)` in `pretrain/config.py` and
`pretrain/sections/`), checked all at once: one line per key, stating the rule (floats must also be finite: nan
and inf are refused by the same check). Plus the one bound that combines keys: the run's sample count within what
Megatron-Core's dataset index can hold."""

from __future__ import annotations

from model_providers.core.knobs import outside_ranges
from pretrain.config import Config, TrainConfig
from pretrain.problems import Report

# Megatron-Core's GPTDataset holds a sample index (2 x int64) and a shuffle index (int64) per sample, built in
# memory by the first rank and cached: more samples than this many bytes hold is not a run any machine starts.
INDEX_BYTES_PER_SAMPLE = 24
MAX_INDEX_BYTES = 1 << 40


def range_rules(r: Report, cfg: Config) -> set[str]:
    """Report every numeric key of the whole config tree outside its declared range (one line each,
    `model_providers.core.knobs.outside_ranges`); returns those keys."""
    bad = set()
    for o in outside_ranges(cfg):
        key, rule, integer, decl = o.key, o.rule, o.integer, o.knob
        bad.add(key)
        why = f" ({decl.why})" if decl.why else ""
        fix = decl.fix.format(key=key) if decl.fix else (
            f"set {key} to {rule.target(integer)}" + (", or null" if o.nullable else "")
            + (f" (default {o.default})" if o.default is not None else ""))
        r.error(key, f"{key}={o.value} must be {rule.words(integer)}{why}", fix)
    return bad


def bounds_rules(r: Report, *, train: TrainConfig) -> None:
    """The run's sample count within what Megatron-Core's dataset index can hold (the single-key ranges:
    `range_rules`, run first by `pretrain.validate.check`)."""
    t = train
    samples = t.steps * t.global_batch_size
    if t.steps >= 1 and t.global_batch_size >= 1 and samples * INDEX_BYTES_PER_SAMPLE > MAX_INDEX_BYTES:
        most = MAX_INDEX_BYTES // INDEX_BYTES_PER_SAMPLE
        r.error(("train.steps", "train.global_batch_size"),
                f"train.steps={t.steps:,} x train.global_batch_size={t.global_batch_size:,} = {samples:,} samples: "
                f"Megatron-Core's dataset index holds {INDEX_BYTES_PER_SAMPLE} bytes per sample "
                f"({samples * INDEX_BYTES_PER_SAMPLE / 2**40:,.0f} TiB), beyond any machine's memory",
                f"train for at most {most:,} samples (train.steps <= {most // t.global_batch_size:,} at this batch "
                "size)")
