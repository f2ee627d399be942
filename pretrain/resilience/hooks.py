"""What the training loop calls: one `Resilience` object per `train()`, built after the data, closed at the end.

    res = Resilience(cfg, run, step, saved, log)    # saved: the checkpoint's run-level state (None: no resume)
    if res.skipped(step + 1): ...                     # train.skip_steps
    res.step_begin(step + 1)                          # arms the watchdog, injected hangs
    loss, fields = res.run_step(step + 1, forward_backward)   # the rerun state machine (may raise ResultRejected)
    res.mark(OPTIMIZER); ...; fields |= res.step_end(step, seconds, timing_fields)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from pretrain.checkpoint.state import RUN_STATE
from pretrain.observe.observers import Observer, StepResult
from pretrain.resilience import results
from pretrain.resilience.faults import Faults
from pretrain.resilience.results import ResultChecks, ResultRejected
from pretrain.resilience.skips import parse_skip_steps
from pretrain.resilience.stragglers import stragglers
from pretrain.resilience.watchdog import PHASES, Watchdog

__all__ = ["FORWARD_BACKWARD", "LOSS", "OPTIMIZER", "Resilience", "ResultRejected", "pg_timeout_minutes",
           "write_status"]
FORWARD_BACKWARD, LOSS, OPTIMIZER, AFTER = PHASES[1:]
RERUN_STATE = "rerun_state"  # the key of the checkpoint's common state
RUN_STATE[RERUN_STATE] = results.checkpoint_state  # saved with every checkpoint, read back on resume


def pg_timeout_minutes(hang) -> float:
    """The default process group's timeout: hang.process_group_timeout_s (of the hang section), else 10 minutes."""
    s = hang.process_group_timeout_s
    return s / 60.0 if s else 10.0


def write_status(run_dir: str | Path, reason: str, step: int, message: str, extra: dict) -> None:
    """`run_dir`/exit_status.json (run.dir) with the fault's fields (the record `pretrain.run.run_dir` writes, and
    more)."""
    from pretrain.files import write_atomic
    from pretrain.run.run_dir import EXIT_STATUS_FILE

    record = {"reason": reason, "step": step, "signal": None, "message": message, **extra}
    write_atomic(Path(run_dir) / EXIT_STATUS_FILE, json.dumps(record) + "\n")


class Resilience:
    """Skips, result validation, the watchdog and stragglers of one run on this rank."""

    def __init__(self, cfg, run, step: int, saved: dict | None, log: Callable[[str], None]):
        """`cfg`: the config tree (the testing, rerun, train, hang, logging and run sections); `saved`: the run-level
        state of the checkpoint resumed from (`CheckpointContext.run_state`), None without a resume."""
        rt = run.rt
        self.cfg, self.log = cfg, log
        self.faults = Faults(cfg.testing, rt.rank)
        self.checks = ResultChecks(cfg.rerun, cfg.train.nan_policy, self.faults, run.model, rt.device)
        results._ACTIVE.append(self.checks)
        if saved is not None:  # a checkpoint without one (older, or written elsewhere): a fresh window
            self.checks.load(saved.get(RERUN_STATE) or {})
        skips, _ = parse_skip_steps(cfg.train.skip_steps)
        self.skips = skips.within(step + 1, cfg.train.steps)
        if self.skips:
            log(f"[pretrain] train.skip_steps: step(s) {self.skips} will be consumed, not trained")
        self.watchdog = Watchdog(cfg.hang, cfg.run.dir, rt.rank, rt.world_size) if cfg.hang.enabled else None
        self.first = True

    def watch_saves(self, async_saves) -> None:
        """A hang report names the writer of an asynchronous save still in flight (`AsyncSaves.in_flight`)."""
        if self.watchdog is not None and async_saves is not None:
            self.watchdog.writers.append(async_saves.in_flight)

    def skipped(self, step: int) -> bool:
        """Step `step` (1-based) is one of train.skip_steps: said in one line; the caller advances past it."""
        if step not in self.skips:
            return False
        self.log(f"[pretrain] step {step}: skipped (train.skip_steps): its samples are consumed, not trained")
        if self.watchdog is not None:
            self.watchdog.arm(step, AFTER, long=True)
        return True

    def step_begin(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.arm(step, PHASES[0], long=self.first)
        self.first = False
        self.faults.in_step(step)

    def mark(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.mark(phase)

    def run_step(self, step: int, forward_backward: Callable[[], float]) -> tuple[float, dict]:
        """The step through the rerun state machine: its loss and the metrics fields of a re-run, if any."""
        loss, verdict = self.checks.run_step(step, forward_backward)
        if verdict is None:
            return loss, {}
        self.log(f"[pretrain] {verdict.line(verdict.action)}")
        return loss, verdict.record(verdict.action)

    def step_end(self, step: int, seconds: float, timing_fields: dict) -> dict:
        """After step `step`: the stragglers' fields; the watchdog's long bound until the next step begins."""
        fields, line = stragglers(timing_fields, self.cfg.logging.straggler_threshold)
        timing_fields.pop("all_compute_s", None)
        if line is not None:
            self.log(f"[pretrain] step {step} {line}")
        if self.watchdog is not None:  # between steps: saves (periodic, on a signal, at the end), evaluation
            self.watchdog.step_done(seconds)
            self.watchdog.arm(step, AFTER, long=True)
        return fields

    def rejected(self, exc: ResultRejected, step: int, writer, rank: int) -> None:
        """After the checkpoint of step `step` (the last good one): the verdict in metrics and exit status."""
        if writer is not None:
            writer.write({"step": step, **exc.record})
        if rank == 0:
            write_status(self.cfg.run.dir, "failed", step, str(exc), exc.record)

    def observer(self) -> Observer:
        """The watchdog's step bounds and the stragglers, as one of the loop's observers."""
        return _Watch(self)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.checks in results._ACTIVE:
            results._ACTIVE.remove(self.checks)


class _Watch(Observer):
    """`Resilience` seen by the loop's observers: arms the watchdog when a step starts, names stragglers and sets
    the next bound when it ends (after the rank timing, whose every-rank compute times it reads and drops)."""

    def __init__(self, res: Resilience):
        self.res = res

    def step_start(self, step: int) -> None:
        self.res.step_begin(step)

    def step_end(self, step: int, result: StepResult) -> None:
        result.extra.update(self.res.step_end(step, result.step_time_s, result.extra))

    def close(self, step: int) -> None:
        self.res.close()

