"""Each piece of a checkpoint owns its rule (`pretrain/checkpoint/stateful.py`): which pieces a save writes and a
load reads, for a resume, a resume at another layout, a weights-only load and `checkpoint.save_optimizer` /
`load_optimizer`. What the files hold and what a load restores are tested through real runs
(`test_checkpointing.py`, `test_resume.py`, `test_cross_version.py`); this is the rule table, in one process."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.mcore


def _taking_part(ctx, op) -> list[str]:
    return [type(piece).__name__ for piece in ctx.states if piece.included(ctx, op)]


def test_each_checkpoint_piece_decides_when_it_takes_part():
    from pretrain.checkpoint.context import CheckpointContext
    from pretrain.checkpoint.stateful import Io
    from pretrain.config import load_config
    from pretrain.run_plan import for_weights

    def context(*overrides: str) -> CheckpointContext:
        plan = for_weights(load_config("tiny_llama", ["model.vocab_size=4096", "parallel.tensor=2", *overrides]), 2)
        return CheckpointContext(model=[], optimizer=None, scheduler="this config's schedule", plan=plan)

    ctx = context()
    plan = ctx.plan
    same = {"layout": list(plan.layout_key()), "optimizer": {}}
    other = {**same, "layout": [*same["layout"][:-1], "another"]}
    everything = ["ModelState", "OptimizerState", "RngState", "ProgressState", "SchedulerState", "RecordState"]

    assert _taking_part(ctx, Io(is_loading=False, step=4)) == everything
    # A load reads the tensors, restores the RNG at the same layout only, takes the step count into this config's
    # schedule, and says which release wrote the checkpoint; step and consumed samples come back from common.pt.
    assert _taking_part(ctx, Io(is_loading=True, common=same)) == [
        "ModelState", "OptimizerState", "RngState", "SchedulerState", "RecordState"]
    assert _taking_part(ctx, Io(is_loading=True, common=other)) == [
        "ModelState", "OptimizerState", "SchedulerState", "RecordState"]
    assert _taking_part(ctx, Io(is_loading=True, common={"layout": same["layout"]})) == [
        "ModelState", "RngState", "SchedulerState", "RecordState"]  # a checkpoint without optimizer state
    assert _taking_part(ctx, Io(is_loading=True, weights_only=True, common=same)) == ["ModelState", "RecordState"]

    ctx = context("checkpoint.save_optimizer=false", "checkpoint.load_optimizer=false")
    assert "OptimizerState" not in _taking_part(ctx, Io(is_loading=False))
    assert "OptimizerState" not in _taking_part(ctx, Io(is_loading=True, common=same))
