"""Megatron's dataset index caches in `data.cache_dir` (default `run.dir/data_cache`): what a build added, and
entries a killed start left truncated.

Megatron-Core names each entry `<hash>-<class>-<split>-<file>` (the hash covers the prefix, split, sample count,
seed, sequence length and tokenizer) and writes its description first, then the arrays with `numpy.save`. It
counts an entry as present when its files exist, so a start killed while writing the last array leaves an entry
that every later start would fail to load; `remove_truncated` deletes such entries (the build then rebuilds them).
Only the rank that builds calls it, before Megatron's build, whose barrier keeps the other ranks from reading.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DESCRIPTION = "-description.txt"
ARRAYS = {
    "GPTDataset": ("document_index.npy", "sample_index.npy", "shuffle_index.npy"),
    "MockGPTDataset": ("document_index.npy", "sample_index.npy", "shuffle_index.npy"),
    "BlendedDataset": ("dataset_index.npy", "dataset_sample_index.npy"),
}


def data_cache_dir(cfg) -> str:
    """Where Megatron's dataset index caches go: data.cache_dir, else run.dir/data_cache (the data check's verdict
    cache too: `pretrain.dataset_format.verdicts`)."""
    return cfg.data.cache_dir or os.path.join(cfg.run.dir, "data_cache")


@dataclass(frozen=True)
class CacheState:
    """The `.npy` files of a cache directory: name -> size in bytes."""

    files: dict[str, int]

    @staticmethod
    def read(cache_dir: str | os.PathLike) -> CacheState:
        files = {}
        with os.scandir(cache_dir) as entries:
            for e in entries:
                if e.name.endswith(".npy") and e.is_file():
                    files[e.name] = e.stat().st_size
        return CacheState(files)

    def added_since(self, before: CacheState) -> tuple[int, int]:
        """(files, bytes) written since `before` (new names, or the same name rewritten at another size)."""
        new = [n for n, size in self.files.items() if before.files.get(n) != size]
        return len(new), sum(self.files[n] for n in new)


def _complete(path: Path) -> bool:
    """The `.npy` holds the bytes its header declares (the header is read, not the array)."""
    try:
        with open(path, "rb") as f:
            fmt = np.lib.format
            version = fmt.read_magic(f)
            shape, _, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(f)
            offset = f.tell()
        return os.stat(path).st_size >= offset + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    except (OSError, ValueError, EOFError):
        return False


def remove_truncated(cache_dir: str | os.PathLike) -> list[str]:
    """Delete the entries whose arrays all exist but do not load (truncated); return their names."""
    removed = []
    for desc in sorted(Path(cache_dir).glob(f"*{DESCRIPTION}")):
        base = desc.name[: -len(DESCRIPTION)]
        parts = base.split("-")
        arrays = ARRAYS.get(parts[1]) if len(parts) >= 3 else None
        if arrays is None:
            continue
        paths = [desc.with_name(f"{base}-{a}") for a in arrays]
        if all(p.is_file() for p in paths) and not all(_complete(p) for p in paths):
            for p in (desc, *paths):
                p.unlink(missing_ok=True)
            removed.append(base)
    return removed
