"""Reading files found in a user-given directory without leaving it: the one owner of that rule.

A directory someone else made (an HF model download, a tokenizer directory, a checkpoint and its `hf_assets/`)
names files by itself: `model.safetensors.index.json` lists shard names, a `vocab.txt` may be a symlink. Every
such name is resolved here and read only when the real file is

- inside the directory (symlinks within it are fine), or
- a HuggingFace cache snapshot's file: the directory is `<cache>/<models--org--name>/snapshots/<rev>` (or below
  it) and the file is the same repository's `blobs/<hash>` — how `huggingface_hub` lays a download out;

and is a regular file (not a FIFO or device that would hang or never end). Anything else is refused with one
line (:class:`UnsafePathError`, a `PermissionError`, so every CLI's `OSError` handler prints it). A path the user
names directly (`--tokenizer-model /x/tokenizer.model`) is the user's choice and is read as named; the rule
is about the names a directory supplies.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

_HF_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


class UnsafePathError(PermissionError):
    """A file a directory names resolves outside it (or is not a regular file); the message says which."""


def _hf_blobs(root: Path) -> Path | None:
    """The `blobs/` directory of the HF cache repository whose snapshot holds `root` (resolved), if any."""
    for snap in (root, *root.parents):
        if snap.parent.name == "snapshots" and snap.parent.parent.name.startswith(_HF_REPO_PREFIXES):
            blobs = snap.parent.parent / "blobs"
            return blobs if blobs.is_dir() else None
    return None


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def inside(directory: str | os.PathLike, name: str | os.PathLike, what: str = "") -> Path:
    """The real path of the file `name` that `directory` names, or :class:`UnsafePathError` (one line).

    `name` is relative to `directory` (a name from an index file, an asset name); `what` says who named it
    (e.g. "named by model.safetensors.index.json") for the message. Raises `FileNotFoundError` when the file
    does not exist.
    """
    root = Path(directory).resolve()
    shown = Path(directory) / name
    by = f" ({what})" if what else ""
    if Path(name).is_absolute():
        raise UnsafePathError(f"{directory}: names the absolute path {name}{by}; only files inside the directory "
                              "are read")
    real = (root / name).resolve()
    if not real.exists():
        raise FileNotFoundError(f"{shown}: no such file{by}")
    if not _within(real, root):
        blobs = _hf_blobs(root)
        if blobs is None or real.parent != blobs.resolve():
            raise UnsafePathError(f"{shown}: resolves to {real}, outside {directory}{by}; refusing to read it "
                                  "(only files inside the directory, or an HF cache snapshot's blobs, are read)")
    mode = real.stat().st_mode
    if not stat.S_ISREG(mode):
        raise UnsafePathError(f"{shown}: not a regular file{by} (resolves to {real}); refusing to read it")
    return real


def read_bytes(directory: str | os.PathLike, name: str | os.PathLike, what: str = "") -> bytes:
    """The content of the file `name` of `directory` (checked by :func:`inside`)."""
    return inside(directory, name, what).read_bytes()


def read_text(directory: str | os.PathLike, name: str | os.PathLike, what: str = "") -> str:
    return inside(directory, name, what).read_text(encoding="utf-8")


def copy_file(directory: str | os.PathLike, name: str, target: str | os.PathLike) -> None:
    """Copy the file `name` of `directory` (checked) to `target`, byte for byte."""
    shutil.copyfile(inside(directory, name), target)


def present(directory: str | os.PathLike, name: str) -> bool:
    """Whether `directory` has an entry `name` (a file or a symlink, dangling or not): what must then be
    read safely or refused, never silently skipped."""
    p = Path(directory) / name
    return p.is_symlink() or p.exists()


def check_directory(directory: str | os.PathLike, what: str = "") -> Path:
    """Check every entry of `directory` (not recursive) that a library will read by itself (e.g.
    `AutoTokenizer.from_pretrained`): each file must pass :func:`inside`. Returns the directory."""
    d = Path(directory)
    for entry in sorted(d.iterdir()):
        if entry.is_symlink() or not entry.is_dir():  # files, links, FIFOs, devices
            try:
                inside(d, entry.name, what)
            except FileNotFoundError:  # a dangling link: nothing is read through it
                continue
    return d
