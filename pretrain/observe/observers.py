"""The loop's one interface to observability: `Observers`, called when a step starts, ends or is skipped, after a
checkpoint save and at exit (the models: Megatron-Bridge's callbacks, TorchTitan's `MetricsProcessor`).

Every instrument and sink is an `Observer` and `build_observers` lists them in the order they run: the profiler's
window, the per-rank timing split, MoE routing and MTP losses, then the step record (throughput, TFLOP/s, MFU,
memory) written to `metrics.jsonl`, TensorBoard and W&B. A new instrument or sink is one class and one line in
`INSTRUMENTS`; the loop (`pretrain.train`) does not change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StepResult:
    """What the loop knows at the end of a step; observers add their fields to `extra` (in order)."""

    loss: float
    grad_norm: float
    step_time_s: float
    consumed_samples: int
    extra: dict = field(default_factory=dict)


class Observer:
    """One instrument or sink; every hook is optional (a no-op here). Hooks run on every rank (some gather)."""

    def step_start(self, step: int) -> None:
        """Before step `step` (1-based) runs."""

    def step_end(self, step: int, result: StepResult) -> None:
        """After step `step` was trained (before its checkpoint and the stop decision)."""

    def step_skipped(self, step: int) -> None:
        """Step `step` was not trained (train.nan_policy=skip): its counters are dropped."""

    def checkpoint(self, step: int, path) -> None:
        """A checkpoint of `step` was saved (or its asynchronous save started) at `path`."""

    def close(self, step: int) -> None:
        """The loop ended at `step` (normally or not)."""


class Observers(Observer):
    """The observers of a run, notified in order."""

    def __init__(self, items: list[Observer | None]):
        self.items = [o for o in items if o is not None]

    def step_start(self, step: int) -> None:
        for o in self.items:
            o.step_start(step)

    def step_end(self, step: int, result: StepResult) -> None:
        for o in self.items:
            o.step_end(step, result)

    def step_skipped(self, step: int) -> None:
        for o in self.items:
            o.step_skipped(step)

    def checkpoint(self, step: int, path) -> None:
        for o in self.items:
            o.checkpoint(step, path)

    def close(self, step: int) -> None:
        for o in self.items:
            o.close(step)


class Profiling(Observer):
    """`logging.profile`'s window (`pretrain.observe.profiling.StepProfiler`)."""

    def __init__(self, profiler):
        self.profiler = profiler

    def step_start(self, step: int) -> None:
        self.profiler.step_begin(step)

    def step_end(self, step: int, result: StepResult) -> None:
        self.profiler.step_end(step)

    def close(self, step: int) -> None:
        self.profiler.close(step)


class Timing(Observer):
    """Every `logging.timing_interval` steps, each rank's compute/wait split (`rank_timing.RankTiming`)."""

    def __init__(self, timing):
        self.timing = timing

    def step_start(self, step: int) -> None:
        self.timing.begin(step)

    def step_end(self, step: int, result: StepResult) -> None:
        result.extra.update(self.timing.end(step))


class MoERouting(Observer):
    """Expert load, aux losses, expert bias and MTP losses (`moe_metrics.MoEMetrics`), read and reset each step."""

    def __init__(self, moe, run):
        self.moe, self.run = moe, run  # the step's microbatches: run.num_microbatches (a ramp changes them)

    def step_end(self, step: int, result: StepResult) -> None:
        result.extra.update(self.moe.step(self.run.num_microbatches))

    def step_skipped(self, step: int) -> None:
        self.moe.step(self.run.num_microbatches)  # the skipped step's counts and trackers are dropped


class StepRecord(Observer):
    """The step's record on the rank that holds the loss: throughput, TFLOP/s, MFU, memory, and what the observers
    before it added; written to the metrics writer (metrics.jsonl, TensorBoard, W&B) and printed every
    `logging.log_interval` steps and at the last one."""

    def __init__(self, cfg, run):
        from pretrain.observe.flops import flops_per_token, gpu_peak_tflops

        self.cfg, self.run = cfg, run
        self.flops_tok = flops_per_token(cfg.model, run.layout.padded_vocab)
        self.peak = gpu_peak_tflops(torch.cuda.get_device_name(), bool(cfg.model.fp8)) if run.rt.on_gpu else None
        self.lr: float | None = None

    def step_start(self, step: int) -> None:
        """The rate this step applies, read before it runs: the loop's `scheduler.step()` after the optimizer step
        sets the next step's (Megatron-Core's schedule at `step - 1` optimizer steps: 0 at step 1 under warmup)."""
        self.lr = self.run.optimizer.param_groups[0]["lr"]

    def step_end(self, step: int, result: StepResult) -> None:
        from pretrain.observe.metrics import format_step_line

        run, total = self.run, self.cfg.train.steps
        if run.writer is None:
            return
        batch = run.global_batch_size or self.cfg.train.global_batch_size
        record: dict[str, Any] = {
            "step": step,
            "loss": result.loss,
            "lr": self.lr,  # the rate the step applied (step_start)
            "grad_norm": result.grad_norm,
            "tokens_per_s": batch * self.cfg.model.seq_length / result.step_time_s,
            "step_time_s": result.step_time_s,
            "consumed_samples": result.consumed_samples,
        }
        if run.stage is not None:  # a run in stages: the stage's name (and number: a TensorBoard / W&B scalar)
            record.update(stage=run.stage.name, stage_index=run.stage.index)
        if run.stage is not None or self.cfg.train.rampup_batch_size is not None:  # the batch may change
            record["global_batch_size"] = batch
        record["tokens_per_s_per_gpu"] = record["tokens_per_s"] / run.rt.world_size
        record["tflops_per_gpu"] = self.flops_tok * record["tokens_per_s_per_gpu"] / 1e12
        if self.peak:
            record["mfu"] = record["tflops_per_gpu"] / self.peak
        if run.rt.on_gpu:
            record["mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        record.update(result.extra)  # the slowest ranks' compute/wait split, MoE routing
        run.writer.write(record)
        if step % self.cfg.logging.log_interval == 0 or step == total:
            print("[pretrain] " + format_step_line(record, total), flush=True)

    def close(self, step: int) -> None:
        if self.run.writer is not None:
            self.run.writer.close()


# The run's observers, in the order they are notified: (config, run) -> an Observer, or None where it is off.
INSTRUMENTS: list[Callable[[Any, Any], Observer | None]] = [
    lambda cfg, run: Profiling(run.profiler),
    lambda cfg, run: Timing(run.timing),
    lambda cfg, run: MoERouting(run.moe, run) if run.moe is not None else None,
    StepRecord,  # last: it writes what the others added
]


def build_observers(cfg, run, *owned: Observer) -> Observers:
    """The run's observers (after set-up built the profiler, timing, MoE hooks and the metrics writer); `owned`:
    observers another part of the run owns (the resilience watch), notified before the step record."""
    items = [make(cfg, run) for make in INSTRUMENTS]
    return Observers([*items[:-1], *owned, items[-1]])
