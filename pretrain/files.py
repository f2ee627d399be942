"""Atomic file writes: a reader sees the old file or the new one, never a partial one.

The one way the project replaces a file: write `PATH.tmp` in the same directory, flush and fsync it, rename
it over `PATH` (`os.replace`, atomic on POSIX), then fsync the directory so the rename itself is durable.
Writers of several files (a dataset's `.bin`/`.idx`) prepare each temporary first and `commit` them in order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def tmp_path(path: str | os.PathLike) -> Path:
    """`PATH.tmp`: the temporary beside `path` that `commit` renames into place."""
    return Path(f"{os.fspath(path)}.tmp")


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make the renames and creations inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str | os.PathLike, data: str | bytes, *, durable: bool = True) -> Path:
    """Write `data` to `path` (text as UTF-8), flushed and, when `durable`, fsynced. Returns `path`."""
    path = Path(path)
    with open(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    return path


def commit(tmp: str | os.PathLike, path: str | os.PathLike, *, durable: bool = True) -> None:
    """Rename the prepared temporary `tmp` over `path` (atomic), then, when `durable`, fsync the directory."""
    os.replace(tmp, path)
    if durable:
        fsync_dir(Path(path).parent)


def write_atomic(path: str | os.PathLike, data: str | bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` atomically (`PATH.tmp`, fsync, rename, fsync of the directory).

    `durable=False` skips both fsyncs: still never a partial file after a crash of the process, for state that
    describes data which is itself not synced (a preprocessing resume point).
    """
    tmp = write_synced(tmp_path(path), data, durable=durable)
    commit(tmp, path, durable=durable)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path to write `path` through (for writers that take a file name); on success it is fsynced
    and renamed into place, on failure removed."""
    tmp = tmp_path(path)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    commit(tmp, path)
