"""Which checkpoint a run resumes from, and starting a run from it or from pretrained weights."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from pretrain.checkpoint import fsdp_format
from pretrain.checkpoint.format import (
    TRACKER,
    CheckpointError,
    checkpoint_root,
    inspect_checkpoint,
    is_committed,
    iteration_dir,
    iterations,
    latest_iteration,
    resolve_checkpoint,
)
from pretrain.checkpoint.load import load_checkpoint


def _names(root: Path, steps: list[int]) -> str:
    return ", ".join(iteration_dir(root, s).name for s in steps)



def resume_step(root: Path) -> tuple[int | None, str | None]:
    """(step to resume from or None, a note for the log); raises CheckpointError when it must refuse.

    The tracker selects the checkpoint. Without one, the newest committed checkpoint is used if it is
    intact. A committed checkpoint is never given up silently: newer committed ones than the tracker's,
    or a damaged newest one without a tracker, stop the run with what to do.
    """
    tracker = root / TRACKER
    steps = iterations(root)
    tracked = latest_iteration(root)
    committed = [s for s in steps if is_committed(iteration_dir(root, s))]
    if tracked is not None:
        newer = [s for s in committed if s > tracked]
        if newer:
            raise CheckpointError(
                f"{tracker}: names iteration {tracked} but newer complete checkpoints exist ({_names(root, newer)}); "
                f"to continue from the newest write {newer[-1]} into it, to go back to {tracked} move the newer "
                f"ones out of {root}")
        return tracked, None
    if not committed:
        partial = f"; partial saves {_names(root, steps)} will be replaced" if steps else ""
        return None, (f"no complete checkpoint in {root}, starting from step 0{partial}" if steps else None)
    newest = iteration_dir(root, committed[-1])
    try:
        inspect_checkpoint(newest)
    except CheckpointError as exc:
        older = f" (older complete: {_names(root, committed[:-1])})" if committed[:-1] else ""
        raise CheckpointError(
            f"{tracker} is missing and the newest complete checkpoint cannot be used{older}: {exc}; write the "
            f"iteration to resume from into {tracker}, after moving {newest.name} out of {root}") from None
    return committed[-1], (f"{tracker} is missing: resuming from the newest complete checkpoint {newest} "
                           f"(complete checkpoints found: {_names(root, committed)})")


def find_resume(cfg) -> tuple[Path | None, str | None]:
    """`resume_step` decided on rank 0 and shared (collective): (checkpoint dir or None, note to log)."""
    root = checkpoint_root(cfg)
    decision: list = [None]
    if dist.get_rank() == 0:
        try:
            decision[0] = ("ok", *resume_step(root))
        except CheckpointError as exc:
            decision[0] = ("error", str(exc), None)
    dist.broadcast_object_list(decision, src=0)
    kind, value, note = decision[0]
    if kind == "error":
        raise CheckpointError(value)
    return (iteration_dir(root, value) if value is not None else None), note



def start_from_checkpoint(cfg, model, optimizer, scheduler, log) -> tuple[int, int, bool]:
    """Resume from the run's own checkpoint, else load `checkpoint.pretrained` weights, else nothing (all ranks).

    Returns (step, consumed_samples, resumed). `log` prints on rank 0.
    """
    latest, note = find_resume(cfg)  # the tracker's, else the newest complete checkpoint
    if note:
        log(f"[pretrain] {note}")
    if latest is not None:
        step, consumed = load_checkpoint(cfg, model, optimizer, scheduler, latest)
        log(f"[pretrain] resumed from {latest} at step {step}")
        return step, consumed, True
    if cfg.checkpoint.pretrained:
        load_checkpoint(cfg, model, optimizer, scheduler, resolve_checkpoint(cfg.checkpoint.pretrained),
                        weights_only=True)
        # Distributed optimizer: main params are copies of the model params made at construction. Megatron-FSDP's
        # main weights are the tensors the load wrote (megatron-core 0.19 raises on reload_model_params).
        if not fsdp_format.is_fsdp(model):
            optimizer.reload_model_params()
        log(f"[pretrain] loaded pretrained weights from {cfg.checkpoint.pretrained}")
    return 0, 0, False

