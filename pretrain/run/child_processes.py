"""Helper processes die with the trainer: no orphans after `kill -9`.

Megatron-Core's `torch_dist` writer uses helper processes: a multiprocessing Manager (spawned, ~270 MB) that
carries write results, the forked asynchronous writer (a copy-on-write snapshot of the trainer, ~600 MB) and
the writer's own forked workers. Killed with SIGKILL, the trainer cannot stop them; they are reparented to
PID 1 and the Manager ignores SIGTERM (see `pretrain.checkpoint.save.start_writer_helper`). On Linux each helper asks
the kernel for SIGKILL when its parent dies (`prctl(PR_SET_PDEATHSIG)`); multiprocessing's resource tracker
then sees its pipe close and exits by itself. Elsewhere these functions do nothing.

Standard library only: `parent_death_signal` runs as the initializer of a freshly spawned interpreter.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1
_hook_installed = False
_fork_from_main_thread = False
_forking_parent = 0


def parent_death_signal(parent_pid: int, blocked: tuple[int, ...] = ()) -> None:
    """In a child process: block `blocked` signals, and be SIGKILLed when the parent `parent_pid` dies.

    Best effort: without Linux's prctl it only blocks the signals. The parent-death signal is tied to the
    parent *thread* that created the child, so only call this for children of a long-lived (main) thread.
    """
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl: nobody will send the signal
        os._exit(1)


def _before_fork() -> None:
    global _fork_from_main_thread, _forking_parent
    _fork_from_main_thread = threading.current_thread() is threading.main_thread()
    _forking_parent = os.getpid()


def _after_fork_in_child() -> None:
    if _fork_from_main_thread:
        parent_death_signal(_forking_parent)


def die_with_this_process() -> None:
    """Every child this process forks from its main thread from now on dies with it (idempotent).

    Covers Megatron's forked asynchronous checkpoint writer and the write workers it forks in turn
    (each of those is forked from its parent's main thread, so the chain unwinds on a kill at any level).
    """
    global _hook_installed
    if _hook_installed or not hasattr(os, "register_at_fork"):
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _hook_installed = True


# /proc/<pid>/stat states, in words (a hang report names what the writer of a checkpoint is doing).
_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped (SIGSTOP)",
           "t": "stopped by a debugger", "Z": "exited, not reaped", "X": "dead", "I": "idle"}


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of `pid` from /proc (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def process_tree(pid: int) -> list[tuple[int, str]]:
    """`pid` and its descendants with their states in words ("stopped (SIGSTOP)", "sleeping", ...): one scan of
    /proc. [(pid, "unknown")] where /proc cannot tell (not Linux, or the process is gone)."""
    own = _stat(pid)
    if own is None:
        return [(pid, "unknown")]
    parents: dict[int, list[tuple[int, str]]] = {}
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        entries = []
    for child in entries:
        found = _stat(child)
        if found is not None:
            parents.setdefault(found[1], []).append((child, found[0]))
    tree, todo = [(pid, own[0])], [pid]
    while todo:
        for child, state in parents.get(todo.pop(), []):
            tree.append((child, state))
            todo.append(child)
    return [(p, _STATES.get(state, state)) for p, state in tree]
