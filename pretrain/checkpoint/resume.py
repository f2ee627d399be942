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
    checkpoint_backend,
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

PRETRAINED_REFUSED = "checkpoint.pretrained: "  # how `preview_start` begins a refusal of the pretrained weights


def _names(root: Path, steps: list[int]) -> str:
    return ", ".join(iteration_dir(root, s).name for s in steps)



def resume_step(root: Path, finish_commit: bool = True) -> tuple[int | None, str | None]:
    """(step to resume from or None, a note for the log); raises CheckpointError when it must refuse.

    The tracker selects the checkpoint. Without one, the newest committed checkpoint is used if it is
    intact. A committed checkpoint is never given up silently: newer committed ones than the tracker's,
    or a damaged newest one without a tracker, stop the run with what to do. `finish_commit=False` (`validate`):
    the same decision, but an interrupted commit is only described, not finished (nothing is written).
    """
    tracker = root / TRACKER
    steps = iterations(root)
    finished, finished_step = _finish_interrupted_commit(root, write=finish_commit)
    if finished:
        return finished_step, finished
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


def _finish_interrupted_commit(root: Path, write: bool = True) -> tuple[str | None, int | None]:
    """A save killed during its commit left `COMMIT_JOURNAL`: if its checkpoint got its run_config.yaml (it is
    complete), move the tracker to it as the commit would have. Returns (a note, the step) when it did (`write`)
    or would (`write=False`: nothing is changed); the journal is removed either way when `write` (an uncommitted
    checkpoint is a partial save, replaced by the next save)."""
    journal = root / COMMIT_JOURNAL
    if not journal.exists():
        return None, None
    step = journal_step(root)
    note = None
    if step is not None and is_committed(iteration_dir(root, step)) and latest_iteration(root) != step:
        if not write:
            return (f"the commit of {iteration_dir(root, step)} was interrupted after it was complete: train moves "
                    f"{TRACKER} to {step}"), step
        try:
            write_atomic(root / TRACKER, f"{step}\n")
        except OSError as exc:
            raise CheckpointError(f"{root / TRACKER}: finishing the interrupted commit of "
                                  f"{iteration_dir(root, step).name} failed ({exc.strerror or exc})") from None
        note = (f"the commit of {iteration_dir(root, step)} was interrupted after it was complete: "
                f"{TRACKER} moved to {step}")
    if write:
        journal.unlink(missing_ok=True)
    return note, (step if note else None)


def _saved_elsewhere(run_dir: str | Path, root: Path, step: int | None,
                     finish_commit: bool = True) -> tuple[Path, int] | None:
    """A complete checkpoint of this run newer than `step` (the newest in `root`) in another checkpoint root this
    run dir `run_dir` saved to (`pretrain.run.run_dir.checkpoint_roots`: checkpoint.dir changed on a resume): (root,
    step)."""
    from pretrain.run.run_dir import checkpoint_roots

    best = None
    for other in checkpoint_roots(run_dir):
        if other.resolve() == root.resolve() or not other.is_dir():
            continue
        committed = [s for s in iterations(other) if is_committed(iteration_dir(other, s))]
        if not committed or committed[-1] <= max(step or 0, best[1] if best else 0):
            continue
        # the same rules there: a rollback or a damaged newest one refuses
        found, _note = resume_step(other, finish_commit)
        if found is not None and found > max(step or 0, best[1] if best else 0):
            best = (other, found)
    return best


def decide_resume(plan, *, finish_commit: bool = True) -> tuple[Path | None, list[str]]:
    """In this process: `resume_step` decided and the resume contract checked, for the run plan `plan` (its config:
    every section, the contract compares the whole tree; its tokenizer): (checkpoint dir or None, lines to log);
    raises CheckpointError where a run must not start. The newest complete checkpoint of the run is used wherever
    this run dir saved it: with checkpoint.dir changed, one in the earlier root that is newer than any in the new
    one is resumed from (and said so); saves go to the new root. `finish_commit=False`: read only
    (`preview_start`)."""
    path, lines, _common = _decide(plan, finish_commit)
    return path, lines


def _decide(plan, finish_commit: bool) -> tuple[Path | None, list[str], dict]:
    cfg = plan.cfg
    root = checkpoint_root(cfg)
    step, note = resume_step(root, finish_commit)
    lines = [note] if note else []
    path = iteration_dir(root, step) if step is not None else None
    elsewhere = _saved_elsewhere(cfg.run.dir, root, step, finish_commit)
    if elsewhere is not None:
        path = iteration_dir(*elsewhere)
        here = f"its newest there is {iteration_dir(root, step).name}" if step is not None else "none there"
        lines.append(f"checkpoint.dir is {root} ({here}), but this run dir saved a newer complete checkpoint "
                     f"at {path}: resuming from it, saving to {root} from now on")
    common: dict = {}
    if path is not None:  # the resume contract, before anything loads
        common = inspect_checkpoint(path)[0]
        lines += check_resume(cfg, path, common, plan.tokenizer)
    return path, lines, common


def preview_start(plan) -> list[str]:
    """What `train` will start from, decided as `start_from_checkpoint` decides, reading only (`validate`; `plan`: the
    run plan): the lines to print, the first one `resume from step N of DIR: what changes` or `start from the
    weights of PATH`; [] for a fresh start. Raises CheckpointError where train would refuse to start (the resume
    contract, an optimizer state that cannot cross formats, an unusable tracker or checkpoint). The tensors
    themselves are compared with the model's only when train builds it (`load.py`)."""
    path, lines, common = _decide(plan, finish_commit=False)
    c, o = plan.cfg.checkpoint, plan.cfg.optimizer
    pretrained = c.pretrained
    if path is not None:
        into_fsdp = bool(o.fsdp)
        if (checkpoint_backend(path) == fsdp_format.FORMAT) != into_fsdp:
            from pretrain.checkpoint.cross_format import crossing_refusal

            error = crossing_refusal(c, o, path, common, into_fsdp)
            if error is not None:
                raise error
        changes = [line.removeprefix("resume: ") for line in lines if line.startswith("resume: ")]
        notes = [line for line in lines if not line.startswith("resume: ")]
        step = int(common.get("iteration", path.name.removeprefix("iter_")))
        unused = [f"checkpoint.pretrained={pretrained} is not used: the run resumes from its own checkpoint"] \
            if pretrained else []
        return [f"resume from step {step} of {path.parent}: {'; '.join(changes) or 'no config change'}",
                *notes, *unused]
    if pretrained:
        try:
            source = resolve_checkpoint(pretrained)
            inspect_checkpoint(source)
        except CheckpointError as exc:
            raise CheckpointError(f"{PRETRAINED_REFUSED}{exc}") from None
        return [*lines, f"start from the weights of {source} (checkpoint.pretrained: weights only; the optimizer, "
                        "LR schedule and step start fresh)"]
    return lines


def find_resume(plan) -> tuple[Path | None, list[str]]:
    """`decide_resume` of the run plan `plan` on rank 0, shared (collective): (checkpoint dir or None, lines to
    log)."""
    decision: list = [None]
    unexpected = None
    if dist.get_rank() == 0:
        try:
            path, lines = decide_resume(plan)
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


def resume_point(root: Path, run_dir: str | Path) -> int | None:
    """The step of the checkpoint the run dir `run_dir` (saving to `root`) resumes from, None for a fresh start
    (collective; decided on rank 0 as `find_resume` decides it, before anything is built: a staged run builds the
    stage that step is in)."""
    decision: list = [None]
    if dist.get_rank() == 0:
        try:
            step, _note = resume_step(root)
            elsewhere = _saved_elsewhere(run_dir, root, step)
            decision[0] = ("ok", elsewhere[1] if elsewhere is not None else step)
        except CheckpointError as exc:
            decision[0] = ("error", str(exc))
    dist.broadcast_object_list(decision, src=0)
    kind, value = decision[0]
    if kind == "error":
        raise CheckpointError(value)
    return value


def start_from_checkpoint(ctx, log) -> tuple[int, int, bool]:
    """Resume from the run's own checkpoint, else load `checkpoint.pretrained` weights, else nothing (all ranks).

    Returns (step, consumed_samples, resumed). `log` prints on rank 0.
    """
    latest, lines = find_resume(ctx.plan)  # the tracker's, else the newest complete checkpoint
    for line in lines:
        log(f"[pretrain] {line}")
    if latest is not None:
        step, consumed = load_checkpoint(ctx, latest)
        log(f"[pretrain] resumed from {latest} at step {step}")
        return step, consumed, True
    pretrained = ctx.settings.pretrained
    if pretrained:
        load_checkpoint(ctx, resolve_checkpoint(pretrained), weights_only=True)  # the optimizer's main params too
        log(f"[pretrain] loaded pretrained weights from {pretrained}")
    return 0, 0, False
