"""Megatron's dataset index caches in `data.cache_dir` (default `run.dir/data_cache`): what a build added, and
entries a killed start left truncated.

Megatron-Core names each entry `<hash>-<class>-<split>-<file>` (the hash covers the prefix, split, sample count,
seed, sequence length and tokenizer) and writes its description first, then the arrays with `numpy.save`. It
counts an entry as present when its files exist, so a start killed while writing the last array leaves an entry
that every later start would fail to load; `remove_truncated` deletes such entries, and entries whose arrays are
not consistent indices (corrupt; checked on a spread of elements), and the build then rebuilds them.
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


SAMPLED_CHECKS = 4096  # elements read per array by `_consistent` (evenly spaced: a start stays fast at any size)


def _spread(a: np.ndarray) -> np.ndarray:
    """Up to SAMPLED_CHECKS evenly spaced elements (rows) of `a`, the last one included."""
    if len(a) <= SAMPLED_CHECKS:
        return np.asarray(a)
    idx = np.linspace(0, len(a) - 1, SAMPLED_CHECKS).astype(np.int64)
    return np.asarray(a[idx])


def _consistent(kind: str, arrays: dict[str, np.ndarray]) -> str | None:
    """Why a complete entry's arrays cannot be Megatron's indices (shapes, ranges, order, checked on a spread of
    elements), or None. Garbage that passes these samples is not excluded; garbage that reaches a batch fails it."""
    if kind == "BlendedDataset":
        ds, sample = arrays["dataset_index.npy"], arrays["dataset_sample_index.npy"]
        if ds.ndim != 1 or sample.shape != ds.shape:
            return "dataset_index and dataset_sample_index differ in shape"
        if (_spread(ds) < 0).any() or (_spread(sample) < 0).any():
            return "negative dataset or sample numbers"
        return None
    doc, sample, shuffle = (arrays[n] for n in ("document_index.npy", "sample_index.npy", "shuffle_index.npy"))
    if doc.ndim != 1 or shuffle.ndim != 1 or sample.ndim != 2 or sample.shape[1] != 2 or len(sample) < 1:
        return "the arrays do not have the shapes of document, sample and shuffle indices"
    rows = _spread(sample)
    if (rows[:, 0] < 0).any() or (rows[:, 0] > len(doc)).any() or (np.diff(rows[:, 0]) < 0).any() \
            or (rows[:, 1] < 0).any():
        return f"sample_index points outside the {len(doc):,} entries of document_index"
    order = _spread(shuffle)
    if (order < 0).any() or (order >= len(sample) - 1).any():
        return f"shuffle_index holds sample numbers outside 0..{len(sample) - 2:,}"
    if (_spread(doc) < 0).any():
        return "document_index holds negative document numbers"
    return None


def remove_truncated(cache_dir: str | os.PathLike) -> list[str]:
    """Delete the entries whose arrays all exist but do not load (truncated) or are not consistent indices
    (`_consistent`: a corrupt entry); return `NAME (why)` for each (the build then rebuilds them)."""
    removed = []
    for desc in sorted(Path(cache_dir).glob(f"*{DESCRIPTION}")):
        base = desc.name[: -len(DESCRIPTION)]
        parts = base.split("-")
        arrays = ARRAYS.get(parts[1]) if len(parts) >= 3 else None
        if arrays is None:
            continue
        paths = [desc.with_name(f"{base}-{a}") for a in arrays]
        if not all(p.is_file() for p in paths):
            continue
        why = None if all(_complete(p) for p in paths) else "truncated, left by an interrupted start"
        if why is None:
            try:
                why = _consistent(parts[1], {a: np.load(p, mmap_mode="r") for a, p in zip(arrays, paths)})
            except (OSError, ValueError) as exc:
                why = f"unreadable ({exc})"
            why = why and f"corrupt: {why}"
        if why is not None:
            for p in (desc, *paths):
                p.unlink(missing_ok=True)
            removed.append(f"{base} ({why})")
    return removed
