"""Saving a checkpoint (synchronous or asynchronous), the atomic commit and pruning.

The tracker is written atomically by rank 0 only after every rank finished writing (for an asynchronous save:
when the save is finalised), so a crash mid-save leaves the previous checkpoint selected.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
from pathlib import Path

import torch.distributed as dist

from pretrain.checkpoint import backends
from pretrain.checkpoint.format import (
    RUN_CONFIG_FILE,
    CheckpointError,
    agree,
    commit_files,
    ends_a_stage,
    is_committed,
    iteration_dir,
    iterations,
    latest_iteration,
    reason,
)
from pretrain.checkpoint.stateful import Io

HELPER_BLOCKED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_WRITER_MANAGER = None


def start_writer_helper() -> None:
    """Start Megatron's checkpoint-writer results Manager so that it ignores SIGTERM/SIGUSR1 (idempotent).

    The `torch_dist` writer reports through a multiprocessing Manager that megatron-core 0.16.1 spawns at the
    first save (`filesystem_async._get_write_results_queue`). Slurm signals every process of a step before a
    time limit or preemption; the freshly spawned interpreter dies of SIGUSR1/SIGTERM and every later save
    fails (EOFError). Here the same Manager is started with those signals blocked in its server process
    (its initializer runs before the server starts threads; it imports only `pretrain.run.child_processes`, which
    is standard library). The trainer keeps its own handlers: it saves and exits on them. The Manager and
    every writer this process forks die with it (`pretrain/run/child_processes.py`), also on `kill -9`.
    """
    global _WRITER_MANAGER
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from pretrain.run.child_processes import die_with_this_process, parent_death_signal

    die_with_this_process()  # the forked writers too: none outlives a killed trainer
    # Its error lines ("Local process 0 encountered an error: ...") repeat what the save's CheckpointError says.
    logging.getLogger(filesystem_async.__name__).setLevel(logging.CRITICAL)
    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=functools.partial(parent_death_signal, os.getpid(), HELPER_BLOCKED_SIGNALS))
    _WRITER_MANAGER = manager
    filesystem_async._results_queue = manager.Queue()



def _commit(ctx, root: Path, path: Path, step: int) -> None:
    """Mark `path` complete and point the tracker at it once every rank has finished writing it (collective)."""
    dist.barrier()
    error = None
    if dist.get_rank() == 0:
        try:
            commit_files(path, ctx.run_config_yaml(), root, step)
        except CheckpointError as exc:
            error = exc
        else:
            _prune(root, ctx.settings.keep_last, current=step)
    agree(error)


def _prune(root: Path, keep_last: int | None, current: int) -> None:
    """Delete checkpoints beyond the newest `keep_last` and partial saves other than `current`.

    A committed checkpoint newer than `current` is kept (only uncommitted leftovers of a crashed save are stale), and
    so is one that ends a stage (`format.ends_a_stage`, docs/training.md "Stages"). Each deletion removes
    `run_config.yaml` first, so a kill in the middle leaves a partial save, never a "complete" checkpoint with files
    missing.
    """
    iters = iterations(root)
    committed = {it for it in iters if is_committed(iteration_dir(root, it))}
    stale = [it for it in iters if it != current and it not in committed]
    kept = [it for it in iters if it <= current and it in committed and not ends_a_stage(iteration_dir(root, it))]
    old = kept[:-keep_last] if keep_last else []
    for it in stale + old:
        path = iteration_dir(root, it)
        (path / RUN_CONFIG_FILE).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)


class AsyncSaves:
    """Megatron-Core's queue of asynchronous `torch_dist` saves, committed when every rank is done.

    At most one save is in flight: scheduling a new one first finalises the previous one.
    """

    def __init__(self) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)
        self.pending: int | None = None
        self.pending_path: Path | None = None
        self.writer = None  # the writer process of the save in flight (multiprocessing.Process)

    def schedule(self, request) -> None:
        self.queue.schedule_async_request(request)
        calls = getattr(self.queue, "async_calls", None)  # megatron-core 0.16-0.19: the caller holds its process
        self.writer = getattr(calls[-1].async_caller, "process", None) if calls else None

    def in_flight(self) -> dict | None:
        """The save not yet committed whose writer has not finished: its iteration, directory and the writer's
        processes with their states (`pretrain.run.child_processes.process_tree`); None otherwise. Read by the hang
        watchdog's thread while the main thread may wait on the writer."""
        from pretrain.run.child_processes import process_tree

        writer, step, path = self.writer, self.pending, self.pending_path
        if step is None or writer is None or writer.pid is None or writer.exitcode is not None:
            return None
        return {"iteration": step, "checkpoint": str(path), "processes": process_tree(writer.pid)}

    def finalize(self, blocking: bool = False) -> list[int]:
        """Commit the saves whose writes finished on every rank (collective; call on all ranks)."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as exc:  # the writer failed, e.g. no space left on device
            error = writer_died(self.pending_path, self.writer) or save_failed(self.pending_path, exc)
            _discard_partial(self.pending_path)
            self.pending = self.pending_path = None
            raise error from exc
        if done:
            self.pending = self.pending_path = None
        return done

    def abort(self) -> None:
        """Stop waiting on the writer (after an error): the checkpoint stays uncommitted."""
        self.queue.close(abort=True)
        self.pending = self.pending_path = None


def save_checkpoint(ctx, *, step: int, consumed_samples: int, async_saves: AsyncSaves | None = None) -> Path:
    """Save a checkpoint for `step` (all ranks call this); the tracker moves once it is complete.

    With `async_saves` the tensors are written by a background process and the checkpoint is committed
    by a later `async_saves.finalize()`; otherwise it is committed before this returns.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    if async_saves is not None and async_saves.pending is not None:
        async_saves.finalize(blocking=True)
    start_writer_helper()
    root = ctx.root
    path = iteration_dir(root, step)
    error = None
    if dist.get_rank() == 0:
        try:
            _prepare_dir(root, path)
        except CheckpointError as exc:
            error = exc
    agree(error)
    backend = backends.for_run(ctx.model)  # Megatron-FSDP: the fsdp_dtensor format, else torch_dist
    op = Io(is_loading=False, step=step, consumed_samples=consumed_samples)
    try:
        request = backend.save(ctx, path, op, async_save=async_saves is not None)
        if async_saves is None:
            _commit(ctx, root, path, step)
        else:
            request.add_finalize_fn(lambda: _commit(ctx, root, path, step))
            async_saves.schedule(request)
            async_saves.pending, async_saves.pending_path = step, path
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # e.g. no space left: one line naming the directory
        error = save_failed(path, exc)
        _discard_partial(path)
        raise error from exc
    return path


def _prepare_dir(root: Path, path: Path) -> None:
    """Create `path` for a save, replacing a partial save left by a crashed run (never a complete one)."""
    if path.exists() and is_committed(path):
        raise CheckpointError(f"{path}: a complete checkpoint is already there; refusing to overwrite it")
    try:
        root.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a partial save from a crashed run, never pointed to
            shutil.rmtree(path)
        path.mkdir()
    except OSError as exc:
        raise CheckpointError(f"{exc.filename or path}: cannot create the checkpoint directory "
                              f"({exc.strerror or exc})") from None


def _discard_partial(path: Path | None) -> None:
    """Rank 0 removes the uncommitted directory of a failed save (every rank has stopped writing to it)."""
    if path is not None and dist.get_rank() == 0 and not is_committed(path):
        shutil.rmtree(path, ignore_errors=True)


def writer_died(path: Path | None, writer) -> CheckpointError | None:
    """The one-line error for an asynchronous writer process that ended without reporting (e.g. killed)."""
    code = getattr(writer, "exitcode", None)
    if path is None or code is None or code == 0:
        return None
    try:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    except ValueError:
        how = f"was killed by signal {-code}"
    try:
        previous = latest_iteration(path.parent)
    except CheckpointError:
        previous = None
    still = f"; the newest complete checkpoint is still {iteration_dir(path.parent, previous).name}" \
        if previous is not None else ""
    return CheckpointError(f"{path}: saving the checkpoint failed: the asynchronous checkpoint writer (pid "
                           f"{writer.pid}) {how} before it finished; nothing was committed{still}")


def check_writable(ctx) -> None:
    """Fail before step 1, not at the first save, when the checkpoint directory cannot be written (collective:
    every rank writes and removes a probe file there). Nothing is checked when the run never saves (periodically,
    at the end, on a signal or at the time limit: the checkpoint and train sections)."""
    c, t = ctx.settings, ctx.plan.cfg.train
    if not (c.interval or c.save_at_end or t.exit_signal_handler or t.exit_duration_in_mins):
        return
    root = ctx.root
    error = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write_test.rank{dist.get_rank()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        error = CheckpointError(f"{exc.filename or root}: checkpoints cannot be written there "
                                f"({exc.strerror or exc}); found before step 1: make it writable or set "
                                "checkpoint.dir to a writable directory")
    agree(error)


def save_failed(path: Path | None, exc: BaseException) -> CheckpointError:
    """The one-line error for a save that failed while writing (e.g. the disk is full)."""
    from pretrain.run.run_dir import write_failure

    why = write_failure(exc, path) if path is not None else None
    return CheckpointError(f"{path}: saving the checkpoint failed: {why or reason(exc)}; nothing was committed")

