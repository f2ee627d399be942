"""The run directory's own files: `config.yaml`, `exit_status.json`, and one-line errors about the file system.

`exit_status.json` says why the trainer stopped; launch/common.sh reads its `reason` to decide on a requeue.
At start rank 0 writes `{"reason": "running", ...}`, so a trainer that is killed (SIGKILL, OOM killer, node
failure) never leaves the status of an earlier run behind: the file says `running` until this run writes
`completed`, `signal`, `time_limit` or `failed`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from pretrain.files import write_atomic

EXIT_STATUS_FILE = "exit_status.json"
HANG_DIR = "hang"  # the hang watchdog's records (pretrain/resilience/watchdog.py)
# Every checkpoint root (checkpoint.dir) this run dir has used, one a line (relative to run.dir when inside it,
# else absolute): a resume finds the run's newest complete checkpoint even after checkpoint.dir changed
# (pretrain.checkpoint.resume).
CHECKPOINT_DIRS = "checkpoint_dirs.txt"
# Errors of the environment (full or read-only disks, permissions), reported as one line naming the path.
_ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG,
                       errno.ENOTDIR, errno.EISDIR}
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG}  # only writing fails with these
FULL_BELOW_BYTES = 1 << 20


class StorageError(RuntimeError):
    """A directory the run writes (run.dir, the data cache) cannot be used: a file, read-only, full."""


def write_exit_status(run_dir: str | Path, reason: str, step: int | None, signal_name: str | None = None,
                      message: str | None = None) -> None:
    """`run_dir`/exit_status.json (run.dir): why the trainer stopped, or `running` (read by launch/ to decide on
    requeue)."""
    path = Path(run_dir) / EXIT_STATUS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"reason": reason, "step": step, "signal": signal_name, "message": message}
    if reason == "running":
        record.update(pid=os.getpid(), host=socket.gethostname(),
                      started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    write_atomic(path, json.dumps(record) + "\n")


def prepare_run_dir(run_dir: str | Path) -> str | None:
    """Create `run_dir` (run.dir) and mark the run as running (rank 0). Returns the error, if any.

    config.yaml is written later (`write_config`), once any checkpoint has loaded into this run's model.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        return f"run.dir {run_dir}: exists and is not a directory"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_exit_status(run_dir, "running", None)
    except OSError as exc:
        return f"run.dir {run_dir}: cannot write {exc.filename or run_dir} ({exc.strerror or exc})"
    return None


def checkpoint_root(cfg) -> Path:
    """Where this run saves checkpoints: checkpoint.dir, else run.dir/checkpoints."""
    return Path(cfg.checkpoint.dir or os.path.join(cfg.run.dir, "checkpoints"))


def write_config(cfg) -> None:
    """run.dir/config.yaml: the config this run trains with (the whole tree), and this run's checkpoint root added
    to `CHECKPOINT_DIRS` (rank 0)."""
    (Path(cfg.run.dir) / "config.yaml").write_text(cfg.to_yaml())
    run_dir = Path(cfg.run.dir).resolve()
    roots = [p.resolve() for p in checkpoint_roots(cfg.run.dir, recorded_only=True)]
    here = checkpoint_root(cfg).resolve()
    if here not in roots:  # inside run.dir: relative to it (a copied run dir does not point back at the original)
        lines = [str(p.relative_to(run_dir)) if p.is_relative_to(run_dir) else str(p) for p in [*roots, here]]
        write_atomic(Path(cfg.run.dir) / CHECKPOINT_DIRS, "".join(f"{line}\n" for line in lines))


def checkpoint_roots(run_dir: str | Path, recorded_only: bool = False) -> list[Path]:
    """Every checkpoint root the run dir `run_dir` saved to: those `CHECKPOINT_DIRS` records, and (unless
    `recorded_only`, for run dirs written before the record) run.dir/checkpoints and the checkpoint.dir of its
    config.yaml."""
    import yaml

    run_dir = Path(run_dir)
    roots: list[Path] = []
    try:
        roots += [run_dir / line for line in (run_dir / CHECKPOINT_DIRS).read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError):
        pass
    if not recorded_only:
        roots.append(run_dir / "checkpoints")
        try:
            saved = yaml.safe_load((run_dir / "config.yaml").read_text())
            earlier = saved.get("checkpoint", {}).get("dir") if isinstance(saved, dict) else None
            if isinstance(earlier, str) and earlier:
                roots.append(Path(earlier))
        except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
            pass
    return list({str(p): p for p in roots}.values())


def report_failure(run_dir: str | Path, message: str, step: int | None = None, printed: bool = True) -> int:
    """An expected failure: one line on stderr (`printed`: by this rank), recorded in exit_status.json with the last
    step reached (rank 0, if this run had marked itself running; best effort). Returns the exit status, 1."""
    if printed:
        print(f"[pretrain] error: {message}", file=sys.stderr, flush=True)
    record_failure(run_dir, message, step)
    return 1


def record_failure(run_dir: str | Path, message: str, step: int | None = None) -> None:
    """`run_dir`/exit_status.json: `failed` with `message`, when this run had marked itself running (rank 0; best
    effort)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    try:
        status = Path(run_dir) / EXIT_STATUS_FILE
        if json.loads(status.read_text()).get("reason") == "running" and not _hang_reported(run_dir, status):
            write_exit_status(run_dir, "failed", step, None, message)
    except (OSError, ValueError, AttributeError):
        pass


def _hang_reported(run_dir: str | Path, running: Path) -> bool:
    """A hang watchdog of this run has fired (a rank's record newer than the `running` status): its `hang` status,
    written after a grace period, is why the run stopped, not the failed collective this rank then sees."""
    since = running.stat().st_mtime
    return any(p.stat().st_mtime >= since for p in (Path(run_dir) / HANG_DIR).glob("rank*.json"))


def exception_summary(exc: BaseException) -> str:
    """One line for an unexpected exception: its type, the first line of its message, and where it was raised
    (`AssertionError at megatron/core/datasets/blended_dataset.py:52` for a bare assert)."""
    import traceback

    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if frames:
        where = frames[-1]
        parts = Path(where.filename).parts
        short = "/".join(parts[parts.index("megatron"):]) if "megatron" in parts else Path(where.filename).name
        line += f" at {short}:{where.lineno}"
    return line[:500]


def environment_error(exc: BaseException | None) -> OSError | None:
    """The OSError of a full, read-only or forbidden file system behind `exc`, if any: its causes and, for
    torch's CheckpointException, each rank's failure included."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        exc = todo.pop()
        if not isinstance(exc, BaseException) or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _ENVIRONMENT_ERRNOS:
            return exc
        todo += [exc.__cause__, exc.__context__]
        failures = getattr(exc, "failures", None)  # {rank: (exception, traceback)}
        for failure in failures.values() if isinstance(failures, dict) else ():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def write_failure(exc: BaseException, directory: str | os.PathLike) -> str | None:
    """Why writing under `directory` failed, when the file system is to blame (full, read-only, forbidden).

    None for other failures. torch's zip writer reports a full disk as "unexpected pos N vs M", without an
    errno, so a file system left with under 1 MiB available counts as full. Call it before removing the
    partial output (which frees the space again).
    """
    os_error = environment_error(exc)
    if os_error is not None and (os_error.errno in _WRITE_ERRNOS or _inside(os_error.filename, directory)):
        return os_error.strerror or str(os_error)
    path = Path(directory)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    if free < FULL_BELOW_BYTES:
        return f"No space left on device ({free:,} bytes free on its file system)"
    return None


def _inside(filename, directory) -> bool:
    if not filename or not isinstance(filename, (str, os.PathLike)):
        return False
    try:
        return Path(filename).resolve().is_relative_to(Path(directory).resolve())
    except (OSError, ValueError):
        return False


def os_error_line(exc: OSError, where: str | None = None) -> str:
    """`PATH: No space left on device` (`where` names the path when the error does not)."""
    path = exc.filename or where
    reason = exc.strerror or str(exc)
    return f"{path}: {reason}" if path else reason
