"""Which rank is slow: every `logging.timing_interval` steps, each rank's step time split into compute and waiting.

On a sampled step (step % timing_interval == 0) every rank measures its wall time and the time it spent waiting:

- data: reading its microbatches (`pretrain.data.datasets.microbatches`);
- pipeline: Megatron-Core's pipeline send/receive timers (`forward-recv`, `backward-send-forward-recv`, ...);
- collectives: Megatron-Core's gradient and parameter synchronisation timers (`all-grads-sync`,
  `embedding-grads-all-reduce`, `params-all-gather`, the optimizer's grad-norm/clip step, ...).

compute = wall − data − pipeline − collectives. A rank that computes slowly makes the others wait in collectives,
so the slow rank is the one with the most compute; its slowdown is its compute over the median compute. The times
are all-gathered, the rank-0 log names the slowest ranks, and the metrics line of that step gets `slowest_ranks`
(up to three: rank, slowdown, compute and waits in seconds), `rank_compute_s_median`, `rank_wait_s_median` and
`max_rank_slowdown` (a scalar, also in TensorBoard/W&B). Tensor-parallel collectives inside the layers are not
timed separately: a slow rank's tensor-parallel peers show part of its delay as compute.

On GPU the timers synchronise the device on sampled steps only. Test hook: `MEGAPRETRAIN_TEST_DELAY_RANK=R:S`
makes rank R sleep S seconds at the start of every step (a straggler for the tests).
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import torch
import torch.distributed as dist

DELAY_ENV = "MEGAPRETRAIN_TEST_DELAY_RANK"
CATEGORIES = ("data", "pipeline", "collectives")
_COLLECTIVE_TIMERS = {
    "all-grads-sync", "conditional-embedder-grads-all-reduce", "non-tensor-parallel-grads-all-reduce",
    "embedding-grads-all-reduce", "params-all-gather", "optimizer-clip-main-grad", "optimizer-count-zeros",
    "optimizer-unscale-and-check-inf",
}  # fmt: skip


def _category(name: str) -> str | None:
    if "send" in name or "recv" in name:
        return "pipeline"
    if name in _COLLECTIVE_TIMERS:
        return "collectives"
    return None


class _Timer:
    """The `start()/stop()` object Megatron-Core's timers return; adds to its category while sampling."""

    def __init__(self, owner: RankTiming, category: str | None):
        self.owner, self.category, self._t0 = owner, category, None

    def start(self, barrier: bool = False) -> None:
        if self.owner.sampling and self.category is not None:
            self.owner.sync()
            self._t0 = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        if self._t0 is not None:
            self.owner.sync()
            self.owner.waits[self.category] += time.perf_counter() - self._t0
            self._t0 = None


class RankTiming:
    """Per-rank step timing. `begin(step)` / `end(step) -> metrics fields` around every step (all ranks)."""

    def __init__(self, interval: int | None, rank: int, world: int, device: torch.device):
        self.interval, self.rank, self.world, self.device = interval, rank, world, device
        self.sampling = False
        self.waits = dict.fromkeys(CATEGORIES, 0.0)
        self._timers: dict[str, _Timer] = {}
        self._t0 = 0.0
        delay = os.environ.get(DELAY_ENV)
        self.delay_s = float(delay.split(":")[1]) if delay and int(delay.split(":")[0]) == rank else 0.0

    def install(self, transformer_config, optimizer) -> None:
        """Hand our timers to Megatron-Core's schedules, gradient finalisation and optimizer."""
        if not self.interval:
            return
        transformer_config.timers = self
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            opt.config.timers = self

    def __call__(self, name: str, log_level: int | None = None) -> _Timer:
        """Megatron-Core's `timers(name, log_level=...)`."""
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = _Timer(self, _category(name))
        return timer

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def wrap(self, category: str, fn):
        """`fn` with its time added to `category` on sampled steps."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not self.sampling:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.waits[category] += time.perf_counter() - t0

        return wrapper

    def begin(self, step: int) -> None:
        """Before running step `step` (1-based)."""
        self.sampling = bool(self.interval) and step % self.interval == 0
        if self.sampling:
            self.waits = dict.fromkeys(CATEGORIES, 0.0)
            self.sync()
            self._t0 = time.perf_counter()
        if self.delay_s:
            time.sleep(self.delay_s)

    def end(self, step: int) -> dict:
        """After step `step`: on a sampled step gather every rank's split (a collective) and summarise it."""
        if not self.sampling:
            return {}
        self.sync()
        wall = time.perf_counter() - self._t0
        self.sampling = False
        mine = torch.tensor([wall, *(self.waits[c] for c in CATEGORIES)], dtype=torch.float64, device=self.device)
        table = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(table, mine)
        rows = [t.tolist() for t in table]
        fields = summarise(rows)
        if self.rank == 0:
            print(f"[pretrain] step {step} timing: {format_summary(fields)}", flush=True)
        return fields


def summarise(rows: list[list[float]], top: int = 3) -> dict:
    """Metrics fields from per-rank rows [wall, data, pipeline, collectives] (seconds), index = global rank."""
    compute = [max(0.0, r[0] - sum(r[1:])) for r in rows]
    median = statistics.median_low(compute)  # a rank's own time: with 2 ranks, the faster one
    order = sorted(range(len(rows)), key=lambda i: compute[i], reverse=True)[:top]

    def slowdown(i: int) -> float:
        return compute[i] / max(median, 1e-9)

    slowest = [{"rank": i, "slowdown": round(slowdown(i), 3), "compute_s": round(compute[i], 6),
                "wait_s": {c: round(rows[i][k + 1], 6) for k, c in enumerate(CATEGORIES)}} for i in order]
    return {
        "slowest_ranks": slowest,
        "max_rank_slowdown": slowdown(order[0]),
        "rank_compute_s_median": median,
        "rank_wait_s_median": {c: statistics.median(r[k + 1] for r in rows) for k, c in enumerate(CATEGORIES)},
    }


def format_summary(fields: dict) -> str:
    """One log line: the slowest ranks with their slowdown, then the median compute and waits."""
    ranks = ", ".join(f"rank {s['rank']} ×{s['slowdown']:.2f} ({s['compute_s'] * 1000:.0f} ms compute)"
                      for s in fields["slowest_ranks"])
    waits = ", ".join(f"{c} {v * 1000:.0f} ms" for c, v in fields["rank_wait_s_median"].items())
    return (f"slowest {ranks}; median compute {fields['rank_compute_s_median'] * 1000:.0f} ms, "
            f"median waits: {waits}")
