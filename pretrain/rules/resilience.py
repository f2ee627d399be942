"""Fault-handling rules: result validation (`rerun`), skipped steps, the hang watchdog, stragglers, and fault
injection (`testing`, refused outside the test suite)."""

from __future__ import annotations

import dataclasses
import os

from pretrain.config import TESTING_ENV, RerunConfig, TestingConfig, TrainConfig
from pretrain.layout import Layout
from pretrain.problems import Report
from pretrain.resilience.skips import beyond, listed, parse_skip_steps

_TEST_DEFAULTS = TestingConfig()


def resilience_rules(r: Report, *, rerun: RerunConfig, train: TrainConfig, testing: TestingConfig,
                     lay: Layout | None) -> None:
    """rerun.*, train.skip_steps, testing.* (their ranges: `pretrain.rules.bounds`)."""
    rr = rerun
    if rr.mode == "report_stats" and report_stats_broken():
        from pretrain.compat import mcore

        r.error("rerun.mode", f"rerun.mode=report_stats: megatron-core {mcore.MCORE}'s determinism report reads "
                "Caller.filename, which its Caller does not have (AttributeError at the second step)",
                "use rerun.mode=validate_results, or a megatron-core whose report works (0.19.2 does)")
    _skip_rules(r, train)
    _testing_rules(r, testing, lay)


def _skip_rules(r: Report, t: TrainConfig) -> None:
    """Every entry of train.skip_steps that is not a step or range, at once; a warning for those beyond train.steps
    (kept: they apply if a resumed run is given more steps)."""
    _, bad = parse_skip_steps(t.skip_steps)
    if len(bad) == 1:
        r.error("train.skip_steps", f"train.skip_steps entry {bad[0]} is not a step (1 or more) or a range \"a-b\"",
                "list steps and ranges, e.g. train.skip_steps=[5,\"10-12\"]")
    elif bad:
        r.error("train.skip_steps", f"train.skip_steps entries {listed(bad)} are not steps (1 or more) or ranges "
                "\"a-b\" (1 <= a <= b)", "list steps and ranges, e.g. train.skip_steps=[5,\"10-12\"]")
    late = beyond(t.skip_steps, t.steps)
    if late:
        steps = t.steps
        r.warnings.append(f"train.skip_steps names steps after train.steps={steps} ({listed(late)}): this run ends "
                          f"at step {steps}, so they are never skipped here (they apply if a resumed run is given "
                          "more train.steps)")


def report_stats_broken() -> bool:
    """Megatron-Core's `RerunStateMachine._maybe_report_stats` reads `caller.filename`, absent from its `Caller`."""
    import inspect

    from megatron.core.rerun_state_machine import Caller, RerunStateMachine

    source = inspect.getsource(RerunStateMachine._maybe_report_stats)
    return "caller.filename" in source and "filename" not in Caller._fields


def _testing_rules(r: Report, testing: TestingConfig, lay: Layout | None) -> None:
    changed = [f.name for f in dataclasses.fields(TestingConfig)
               if getattr(testing, f.name) != getattr(_TEST_DEFAULTS, f.name)]
    if not changed:
        return
    if os.environ.get(TESTING_ENV) != "1":
        r.error(f"testing.{changed[0]}", f"testing.{changed[0]} injects a fault: it is for the test suite only "
                f"({TESTING_ENV}=1)", "remove the testing.* keys")
        return
    t = testing
    world = lay.world if lay is not None else None
    for key in ("nan_rank", "spike_rank", "hang_rank", "slow_rank"):
        value = getattr(t, key)
        if world is not None and value is not None and 0 <= value and value >= world:  # < 0: the range rule's
            r.error(f"testing.{key}", f"testing.{key}={value} is not a rank of world size {world}",
                    f"set testing.{key} below {world}")
