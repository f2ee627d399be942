"""Faults injected on purpose, for the test suite (`testing.*`, allowed only with PRETRAIN_TESTING=1).

NaN or spiky loss on one rank at one step (once: the re-run is clean, a transient fault; always: every run of
that step, a persistent one), a rank that hangs in a step (sleeps forever, or stops itself with SIGSTOP), and a
rank that is slow in every step (a straggler). A rank sees its injected loss; the others see the true one, so
Megatron-Core's `RerunStateMachine` has to find the faulty rank as it would on a cluster."""

from __future__ import annotations

import os
import signal
import time

from pretrain.config import TestingConfig


class Faults:
    """The injected faults of this rank. `loss(step, value)` on every run of a step, `in_step(step)` at its start."""

    def __init__(self, testing: TestingConfig, rank: int):
        self.t, self.rank = testing, rank
        self.runs: dict[tuple[str, int], int] = {}  # (kind, step) -> times injected in this process

    def _fires(self, kind: str, step: int, at: int | None, on_rank: int, times: str) -> bool:
        if at is None or step != at or self.rank != on_rank:
            return False
        n = self.runs.get((kind, step), 0)
        self.runs[(kind, step)] = n + 1
        return times == "always" or n == 0

    def loss(self, step: int, value: float) -> float:
        """This rank's view of the step's loss, with a NaN or a spike injected."""
        t = self.t
        if self._fires("nan", step, t.nan_step, t.nan_rank, t.nan_times):
            return float("nan")
        if self._fires("spike", step, t.spike_step, t.spike_rank, t.spike_times):
            return value * t.spike_scale
        return value

    def in_step(self, step: int) -> None:
        """At the start of a step: hang forever, or stop, or be slow, as configured for this rank."""
        t = self.t
        if t.slow_rank is not None and t.slow_rank == self.rank and t.slow_s > 0:
            time.sleep(t.slow_s)
        if t.hang_step is not None and step == t.hang_step and self.rank == t.hang_rank:
            print(f"[pretrain] testing: rank {self.rank} hangs in step {step} ({t.hang_how})", flush=True)
            if t.hang_how == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            while True:
                time.sleep(3600)
