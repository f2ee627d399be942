"""The range of every numeric setting, read from its declaration (`knob(range=...)` in `pretrain/config.py` and
`pretrain/sections/`), checked all at once: one line per key, stating the rule (floats must also be finite: nan
and inf are refused by the same check). Plus the one bound that combines keys: the run's sample count within what
Megatron-Core's dataset index can hold."""

from __future__ import annotations

import functools
import typing

from model_providers.core.knobs import Range, knob_of, leaves, number_types
from pretrain.config import Config, TrainConfig
from pretrain.problems import Report

FINITE = Range.parse("finite")  # a float field that declares no range
# Megatron-Core's GPTDataset holds a sample index (2 x int64) and a shuffle index (int64) per sample, built in
# memory by the first rank and cached: more samples than this many bytes hold is not a run any machine starts.
INDEX_BYTES_PER_SAMPLE = 24
MAX_INDEX_BYTES = 1 << 40


@functools.lru_cache(maxsize=4)
def numeric_fields(tree: type = Config) -> tuple[tuple[str, object, bool, bool], ...]:
    """(dotted key, declaration, integer?, may be null?) of every int or float leaf of the config tree."""
    out = []
    for key, section, f in leaves(tree):
        hint = typing.get_type_hints(section)[f.name]
        numbers = number_types(hint)
        if numbers:
            out.append((key, knob_of(f), float not in numbers, type(None) in typing.get_args(hint)))
    return tuple(out)


def _value(cfg: Config, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def range_rules(r: Report, cfg: Config) -> set[str]:
    """Report every numeric key outside its declared range (one line each); returns those keys."""
    bad = set()
    for key, decl, integer, nullable in numeric_fields(type(cfg)):
        value = _value(cfg, key)
        if value is None or isinstance(value, (bool, list)):  # a list (per-layer choices) has its own rule
            continue
        rule = decl.range or (None if integer else FINITE)
        if rule is None or rule.holds(value):
            continue
        bad.add(key)
        why = f" ({decl.why})" if decl.why else ""
        fix = decl.fix.format(key=key) if decl.fix else (
            f"set {key} to {rule.target(integer)}" + (", or null" if nullable else "")
            + (f" (default {_default(cfg, key)})" if _default(cfg, key) is not None else ""))
        r.error(key, f"{key}={value} must be {rule.words(integer)}{why}", fix)
    return bad


def _default(cfg: Config, key: str):
    return _value(type(cfg)(), key)


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
