"""Fault-handling rules: result validation (`rerun`), skipped steps, the hang watchdog, stragglers, and fault
injection (`testing`, refused outside the test suite)."""

from __future__ import annotations

import dataclasses
import math
import os

from pretrain.config import TESTING_ENV, Config, TestingConfig
from pretrain.layout import Layout
from pretrain.problems import Report
from pretrain.resilience.skips import beyond, listed, parse_skip_steps

_TEST_DEFAULTS = TestingConfig()
_FAULT_KEYS = ("nan_step", "spike_step", "hang_step", "slow_rank")


def resilience_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """rerun.*, train.skip_steps, hang.*, logging.straggler_threshold, testing.*."""
    rr, h = cfg.rerun, cfg.hang
    if rr.mode == "report_stats" and report_stats_broken():
        from pretrain.compat import mcore

        r.error("rerun.mode", f"rerun.mode=report_stats: megatron-core {mcore.MCORE}'s determinism report reads "
                "Caller.filename, which its Caller does not have (AttributeError at the second step)",
                "use rerun.mode=validate_results, or a megatron-core whose report works (0.19.2 does)")
    if rr.spike_factor is not None and not (math.isfinite(rr.spike_factor) and rr.spike_factor > 1):
        r.error("rerun.spike_factor", f"rerun.spike_factor={rr.spike_factor} must be above 1",
                "set a factor such as 10, or null for no spike check")
    if rr.spike_window < 1:
        r.error("rerun.spike_window", f"rerun.spike_window={rr.spike_window} must be at least 1",
                "set the number of steps whose loss sets the spike maximum (e.g. 100)")
    _skip_rules(r, cfg)
    for key, value in (("hang.factor", h.factor), ("hang.floor_s", h.floor_s), ("hang.long_s", h.long_s)):
        if not (math.isfinite(value) and value > 0):
            r.error(key, f"{key}={value} must be a positive number", f"set {key} above 0")
    if h.factor <= 1 and h.factor > 0:
        r.error("hang.factor", f"hang.factor={h.factor} must be above 1 (a step may take factor x the median)",
                "set hang.factor to e.g. 10")
    if h.process_group_timeout_s is not None and not h.process_group_timeout_s > 0:
        r.error("hang.process_group_timeout_s", f"hang.process_group_timeout_s={h.process_group_timeout_s} must "
                "be positive", "set seconds above 0, or null for torch's default")
    if not cfg.logging.straggler_threshold > 0:
        r.error("logging.straggler_threshold", f"logging.straggler_threshold={cfg.logging.straggler_threshold} "
                "must be positive", "set the fraction over the median compute that names a rank, e.g. 0.2")
    _testing_rules(r, cfg, lay)


def _skip_rules(r: Report, cfg: Config) -> None:
    """Every entry of train.skip_steps that is not a step or range, at once; a warning for those beyond train.steps
    (kept: they apply if a resumed run is given more steps)."""
    _, bad = parse_skip_steps(cfg.train.skip_steps)
    if len(bad) == 1:
        r.error("train.skip_steps", f"train.skip_steps entry {bad[0]} is not a step (1 or more) or a range \"a-b\"",
                "list steps and ranges, e.g. train.skip_steps=[5,\"10-12\"]")
    elif bad:
        r.error("train.skip_steps", f"train.skip_steps entries {listed(bad)} are not steps (1 or more) or ranges "
                "\"a-b\" (1 <= a <= b)", "list steps and ranges, e.g. train.skip_steps=[5,\"10-12\"]")
    late = beyond(cfg.train.skip_steps, cfg.train.steps)
    if late:
        steps = cfg.train.steps
        r.warnings.append(f"train.skip_steps names steps after train.steps={steps} ({listed(late)}): this run ends "
                          f"at step {steps}, so they are never skipped here (they apply if a resumed run is given "
                          "more train.steps)")


def report_stats_broken() -> bool:
    """Megatron-Core's `RerunStateMachine._maybe_report_stats` reads `caller.filename`, absent from its `Caller`."""
    import inspect

    from megatron.core.rerun_state_machine import Caller, RerunStateMachine

    source = inspect.getsource(RerunStateMachine._maybe_report_stats)
    return "caller.filename" in source and "filename" not in Caller._fields


def _testing_rules(r: Report, cfg: Config, lay: Layout | None) -> None:
    changed = [f.name for f in dataclasses.fields(TestingConfig)
               if getattr(cfg.testing, f.name) != getattr(_TEST_DEFAULTS, f.name)]
    if not changed:
        return
    if os.environ.get(TESTING_ENV) != "1":
        r.error(f"testing.{changed[0]}", f"testing.{changed[0]} injects a fault: it is for the test suite only "
                f"({TESTING_ENV}=1)", "remove the testing.* keys")
        return
    t = cfg.testing
    for key in _FAULT_KEYS:
        value = getattr(t, key)
        if value is not None and value < (0 if key == "slow_rank" else 1):
            r.error(f"testing.{key}", f"testing.{key}={value} is out of range", f"set testing.{key} to a step or rank")
    world = lay.world if lay is not None else None
    for key in ("nan_rank", "spike_rank", "hang_rank", "slow_rank"):
        value = getattr(t, key)
        if world is not None and value is not None and not 0 <= value < world:
            r.error(f"testing.{key}", f"testing.{key}={value} is not a rank of world size {world}",
                    f"set testing.{key} below {world}")
