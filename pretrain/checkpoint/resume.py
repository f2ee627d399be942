"""Which checkpoint a run resumes from, and starting a run from it or from pretrained weights."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from pretrain.checkpoint import fsdp_format
from pretrain.checkpoint.contract import check_resume
from pretrain.checkpoint.format import (
    COMMIT_JOURNAL,
    TRACKER,
    CheckpointError,
    checkpoint_root,
    inspect_checkpoint,
    is_committed,
    iteration_dir,
    iterations,
    journal_step,
    latest_iteration,
    resolve_checkpoint,
)
from pretrain.checkpoint.load import load_checkpoint
from pretrain.files import write_atomic


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
    finished = _finish_interrupted_commit(root)
    tracked = latest_iteration(root)
    committed = [s for s in steps if is_committed(iteration_dir(root, s))]
    if finished:
        return tracked, finished
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


def _finish_interrupted_commit(root: Path) -> str | None:
    """A save killed during its commit left `COMMIT_JOURNAL`: if its checkpoint got its run_config.yaml (it is
    complete), move the tracker to it as the commit would have. Returns a note when it did; the journal is
    removed either way (an uncommitted checkpoint is a partial save, replaced by the next save)."""
    journal = root / COMMIT_JOURNAL
    if not journal.exists():
        return None
    step = journal_step(root)
    note = None
    if step is not None and is_committed(iteration_dir(root, step)) and latest_iteration(root) != step:
        try:
            write_atomic(root / TRACKER, f"{step}\n")
        except OSError as exc:
            raise CheckpointError(f"{root / TRACKER}: finishing the interrupted commit of "
                                  f"{iteration_dir(root, step).name} failed ({exc.strerror or exc})") from None
        note = (f"the commit of {iteration_dir(root, step)} was interrupted after it was complete: "
                f"{TRACKER} moved to {step}")
    journal.unlink(missing_ok=True)
    return note


def _saved_elsewhere(cfg, root: Path, step: int | None) -> tuple[Path, int] | None:
    """A complete checkpoint of this run newer than `step` (the newest in `root`) in another checkpoint root this
    run dir saved to (`pretrain.run.run_dir.checkpoint_roots`: checkpoint.dir changed on a resume): (root, step)."""
    from pretrain.run.run_dir import checkpoint_roots

    best = None
    for other in checkpoint_roots(cfg):
        if other.resolve() == root.resolve() or not other.is_dir():
            continue
        committed = [s for s in iterations(other) if is_committed(iteration_dir(other, s))]
        if not committed or committed[-1] <= max(step or 0, best[1] if best else 0):
            continue
        found, _note = resume_step(other)  # the same rules there: a rollback or a damaged newest one refuses
        if found is not None and found > max(step or 0, best[1] if best else 0):
            best = (other, found)
    return best


def find_resume(cfg, tokenizer=None) -> tuple[Path | None, list[str]]:
    """`resume_step` decided and the resume contract checked on rank 0, shared (collective): (checkpoint dir or
    None, lines to log). The newest complete checkpoint of the run is used wherever this run dir saved it: with
    checkpoint.dir changed, one in the earlier root that is newer than any in the new one is resumed from (and
    said so); saves go to the new root. `tokenizer`: the run's `TokenizerPlan` (the contract compares it)."""
    root = checkpoint_root(cfg)
    decision: list = [None]
    unexpected = None
    if dist.get_rank() == 0:
        try:
            step, note = resume_step(root)
            lines = [note] if note else []
            path = iteration_dir(root, step) if step is not None else None
            elsewhere = _saved_elsewhere(cfg, root, step)
            if elsewhere is not None:
                path = iteration_dir(*elsewhere)
                here = f"its newest there is {iteration_dir(root, step).name}" if step is not None else "none there"
                lines.append(f"checkpoint.dir is {root} ({here}), but this run dir saved a newer complete checkpoint "
                             f"at {path}: resuming from it, saving to {root} from now on")
            if path is not None:  # the resume contract, before anything loads
                lines += check_resume(cfg, path, inspect_checkpoint(path)[0], tokenizer)
            decision[0] = ("ok", str(path) if path is not None else None, lines)
        except CheckpointError as exc:
            decision[0] = ("error", str(exc), None)
        except Exception as exc:  # not expected: its traceback on rank 0, and no rank left waiting
            unexpected = exc
            decision[0] = ("error", f"rank 0 failed deciding the resume ({type(exc).__name__}: {exc})", None)
    dist.broadcast_object_list(decision, src=0)
    if unexpected is not None:
        raise unexpected
    kind, value, lines = decision[0]
    if kind == "error":
        error = CheckpointError(value)
        error.every_rank = True  # rank 0's decision, the same words on every rank: printed once
        raise error
    return (Path(value) if value is not None else None), lines


def start_from_checkpoint(ctx, log) -> tuple[int, int, bool]:
    """Resume from the run's own checkpoint, else load `checkpoint.pretrained` weights, else nothing (all ranks).

    Returns (step, consumed_samples, resumed). `log` prints on rank 0.
    """
    cfg, model, optimizer = ctx.cfg, ctx.model, ctx.optimizer
    latest, lines = find_resume(cfg, ctx.plan.tokenizer)  # the tracker's, else the newest complete checkpoint
    for line in lines:
        log(f"[pretrain] {line}")
    if latest is not None:
        step, consumed = load_checkpoint(ctx, latest)
        log(f"[pretrain] resumed from {latest} at step {step}")
        return step, consumed, True
    if cfg.checkpoint.pretrained:
        load_checkpoint(ctx, resolve_checkpoint(cfg.checkpoint.pretrained), weights_only=True)
        # Distributed optimizer: main params are copies of the model params made at construction. Megatron-FSDP's
        # main weights are the tensors the load wrote (megatron-core 0.19 raises on reload_model_params).
        if not fsdp_format.is_fsdp(model):
            optimizer.reload_model_params()
        log(f"[pretrain] loaded pretrained weights from {cfg.checkpoint.pretrained}")
    return 0, 0, False

