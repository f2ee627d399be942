"""Stragglers: on every `logging.timing_interval`-th step, the ranks whose compute time is more than
`logging.straggler_threshold` over the median (from `pretrain.observe.rank_timing`'s all-gathered split), named in one
line and in the step's metrics (`stragglers`: ranks; `straggler_count`: a scalar for TensorBoard/W&B)."""

from __future__ import annotations


def stragglers(fields: dict, threshold: float) -> tuple[dict, str | None]:
    """Metrics fields and the line to print (None: no timing on this step). `fields`: `rank_timing.summarise`'s."""
    if not fields or "all_compute_s" not in fields:
        return {}, None
    median = max(fields["rank_compute_s_median"], 1e-9)
    slow = [(r, c / median - 1) for r, c in enumerate(fields["all_compute_s"]) if c > median * (1 + threshold)]
    out = {"stragglers": [r for r, _ in slow], "straggler_count": len(slow)}
    if not slow:
        return out, None
    named = ", ".join(f"rank {r} +{x * 100:.0f}%" for r, x in slow)
    return out, (f"stragglers: {named} compute over the median ({median * 1000:.0f} ms; threshold "
                 f"+{threshold * 100:.0f}%)")
