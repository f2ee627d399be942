"""Bounds of integer settings no other rule checks: values that would pass the type check and then fail far
from the config (a division by zero in logging, numpy's seed range, a dataset index larger than any memory)."""

from __future__ import annotations

from pretrain.config import Config
from pretrain.layout import Layout
from pretrain.problems import Report

SEED_MAX = 2**32 - 1  # numpy.random.RandomState, which Megatron-Core's datasets seed with train.seed
# Megatron-Core's GPTDataset holds a sample index (2 x int64) and a shuffle index (int64) per sample, built in
# memory by the first rank and cached: more samples than this many bytes hold is not a run any machine starts.
INDEX_BYTES_PER_SAMPLE = 24
MAX_INDEX_BYTES = 1 << 40


def bounds_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Integer settings: at least 1 where they count steps or layers, the seed in numpy's range, and the run's
    sample count within what Megatron-Core's dataset index can hold."""
    o, t, m = cfg.optimizer, cfg.train, cfg.model
    at_least_one = {
        "logging.log_interval": cfg.logging.log_interval,
        "optimizer.decay_steps": o.decay_steps,  # null: train.steps (0 would silently mean the same)
        "model.recompute_num_layers": m.recompute_num_layers,
        "model.rope_scaling_original_max_position_embeddings": m.rope_scaling_original_max_position_embeddings,
    }
    if not (o.decay_style == "WSD" and o.wsd_decay_steps == 0):  # that one is reported by the WSD rule
        at_least_one["optimizer.wsd_decay_steps"] = o.wsd_decay_steps
    for key, value in at_least_one.items():
        if value is not None and value < 1:
            r.error(key, f"{key}={value} must be at least 1", f"set {key} to a positive integer"
                    + (" or null" if key != "logging.log_interval" else ""))
    if not 0 <= t.seed <= SEED_MAX:
        r.error("train.seed", f"train.seed={t.seed} is outside 0..{SEED_MAX:,} (numpy's seed range, which "
                "Megatron-Core's datasets use)", "choose a seed in that range")
    samples = t.steps * t.global_batch_size
    if t.steps >= 1 and t.global_batch_size >= 1 and samples * INDEX_BYTES_PER_SAMPLE > MAX_INDEX_BYTES:
        most = MAX_INDEX_BYTES // INDEX_BYTES_PER_SAMPLE
        r.error(("train.steps", "train.global_batch_size"),
                f"train.steps={t.steps:,} x train.global_batch_size={t.global_batch_size:,} = {samples:,} samples: "
                f"Megatron-Core's dataset index holds {INDEX_BYTES_PER_SAMPLE} bytes per sample "
                f"({samples * INDEX_BYTES_PER_SAMPLE / 2**40:,.0f} TiB), beyond any machine's memory",
                f"train for at most {most:,} samples (train.steps <= {most // t.global_batch_size:,} at this batch "
                "size)")
