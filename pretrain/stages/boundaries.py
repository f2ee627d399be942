"""What the trainer does at a stage's start and end (`pretrain.train`).

- Start: the stage is the one the checkpoint's step is in (`resumed_stage`, before anything is built); its data
  begins at the first sample of its own blend: the loop reads sample `consumed - first_sample` of the stage's
  dataset. `first_sample` is the consumed-sample count where the stage began: the checkpoint's at the stage's first
  step, else the one the checkpoint records (`stage` in its common state: name, start step, first sample; read by
  the resume, `CheckpointContext.run_state`), so a resume mid-stage continues the stage's order exactly.
- End: the checkpoint of the stage's last step is saved and named for it (`stage_NAME` in the checkpoint root,
  kept whatever checkpoint.keep_last says; one a killed run saved but had not named is named when the run restarts,
  by `resumed_stage`); the next stage then runs in this process, rebuilt from that checkpoint
  as a restart would, or, where it changes the process groups (`StagedRun.new_process`, decided when the run is
  resolved: `pretrain/stages/plan.py`), the trainer exits with
  `EXIT_NEXT_STAGE` (76) and the same command (or the Slurm requeue) continues in it.
"""

from __future__ import annotations

import torch.distributed as dist

from pretrain.checkpoint.state import RUN_STATE
from pretrain.stages.plan import StagedRun
from pretrain.stages.spec import Stage

EXIT_NEXT_STAGE = 76  # the next stage needs a new process: run the same command again (launch/common.sh requeues)
STAGE_STATE = "stage"  # the key of the checkpoint's common state
_RUNNING: dict = {}  # the record of the stage this process trains: saved with every checkpoint
RUN_STATE[STAGE_STATE] = lambda: dict(_RUNNING) or None


def resumed_stage(staged: StagedRun) -> Stage:
    """The stage the run continues in: that of its checkpoint's step (collective; the first without one). The
    stage-ending checkpoints up to that step are named for their stages first (those a killed run saved but had not
    named)."""
    if not staged.staged:
        return staged.stages[0]
    from pretrain.checkpoint.format import checkpoint_root
    from pretrain.checkpoint.resume import resume_point

    cfg = staged.plans[0].cfg
    step = resume_point(checkpoint_root(cfg), cfg.run.dir) or 0
    name_boundaries(staged, step)
    return staged.at(step)


def enter(staged: StagedRun, stage: Stage, step: int, consumed: int, saved: dict | None, log) -> int:
    """Start training `stage` at `step` with `consumed` samples behind (`saved`: the run-level state of the
    checkpoint resumed from, None without one): keep the stage's record for the checkpoints and return its first
    sample."""
    from pretrain.checkpoint.format import CheckpointError

    _RUNNING.clear()
    if not staged.staged:
        return 0
    if step == stage.start_step:
        first = consumed
    else:
        record = (saved or {}).get(STAGE_STATE)
        if record is None:
            first = stage.first_sample
            log(f"[pretrain] stage '{stage.name}': the checkpoint of step {step} records no stage; its data began at "
                f"sample {first:,} (the stages' count)")
        elif record.get("name") == stage.name and record.get("start_step") == stage.start_step:
            first = int(record["first_sample"])
        else:
            raise CheckpointError(
                f"the checkpoint of step {step} was written in stage '{record.get('name')}' (from step "
                f"{record.get('start_step')}), but this config puts step {step + 1} in stage '{stage.name}' (from step "
                f"{stage.start_step}): a stage that has started cannot move (change only stages still ahead)")
    _RUNNING.update(name=stage.name, index=stage.index, start_step=stage.start_step, first_sample=first)
    log(f"[pretrain] stage '{stage.name}' ({stage.index + 1} of {len(staged.stages)}): steps {stage.start_step + 1}-"
        f"{stage.end_step}, its data from sample {consumed - first:,} of its own"
        + (f"; set {', '.join(f'{k}={v}' for k, v in stage.sets.items())}" if stage.sets else ""))
    return first


def leave() -> None:
    """The process trains no stage any more (no record in later checkpoints, e.g. of the next run in a pool)."""
    _RUNNING.clear()


def name_boundaries(staged: StagedRun, step: int) -> None:
    """Rank 0 names every stage-ending checkpoint up to `step` for its stage (collective: all ranks agree)."""
    from pretrain.checkpoint.format import (
        CheckpointError,
        agree,
        checkpoint_root,
        is_committed,
        iteration_dir,
        name_checkpoint,
    )

    error = None
    if dist.get_rank() == 0:
        root = checkpoint_root(staged.plans[0].cfg)
        for stage in staged.stages[:-1]:
            path = iteration_dir(root, stage.end_step)
            if stage.end_step <= step and is_committed(path):
                try:
                    name_checkpoint(root, stage.end_step, stage.name)
                except OSError as exc:
                    error = CheckpointError(f"{path}: naming it for stage '{stage.name}' failed "
                                            f"({exc.strerror or exc})")
    agree(error)
