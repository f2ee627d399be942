"""Megatron's dataset index caches in `data.cache_dir` (default `run.dir/data_cache`): what a build added, entries
a killed start left truncated, and a digest of every entry, checked before Megatron reads it.

Megatron-Core names each entry `<hash>-<class>-<split>-<file>` (the hash covers the prefix, split, sample count,
seed, sequence length and tokenizer) and writes its description first, then the arrays with `numpy.save`. It
counts an entry as present when its files exist, and trusts whatever they hold. Before the build, `check_entries`
deletes (and the build then rebuilds, one line each): an entry a killed start left truncated; one whose arrays are
not a `.npy` file (unreadable) or not consistent indices (checked on a spread of elements); one without the digest
file this trainer writes beside every entry it built (`<entry>-digests.json`, `record_digests` after the build:
each array's size and a CRC-32 per 64 MiB); and one whose arrays no longer match their digests (a file overwritten
with other values of the right shape and dtype looks valid). The CRCs cover the whole file, its chunks hashed on a
pool of threads; a file whose inode, size and ctime are those of its last check (the kernel changes ctime on every
write, and no call sets it back) is not read again. Only the rank that builds calls these, before Megatron's
build, whose barrier keeps the other ranks from reading.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DESCRIPTION = "-description.txt"
DIGESTS = "-digests.json"  # beside each entry: its arrays' sizes and CRC-32 (this trainer's, not Megatron's)
DIGEST_FORMAT = "megapretrain-index-cache-digests"
CHUNK_BYTES = 64 << 20  # one CRC-32 per chunk: the chunks of a large array are hashed in parallel
HASH_THREADS = min(16, os.cpu_count() or 1)
ARRAYS = {
    "GPTDataset": ("document_index.npy", "sample_index.npy", "shuffle_index.npy"),
    "MockGPTDataset": ("document_index.npy", "sample_index.npy", "shuffle_index.npy"),
    "BlendedDataset": ("dataset_index.npy", "dataset_sample_index.npy"),
}


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


def _incomplete(path: Path) -> str | None:
    """Why the `.npy` does not hold the bytes its header declares (the header is read, not the array), or None:
    `truncated` when the header is readable and the file shorter than it declares, else `unreadable`."""
    try:
        with open(path, "rb") as f:
            fmt = np.lib.format
            version = fmt.read_magic(f)
            shape, _, dtype = (fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0)(f)
            offset = f.tell()
        need = offset + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    except (OSError, ValueError, EOFError, TypeError) as exc:
        return f"unreadable: {_short(path)} is not a .npy file ({str(exc).splitlines()[0] if str(exc) else exc})"
    have = os.stat(path).st_size
    return f"truncated, left by an interrupted start: {_short(path)} has {have:,} of {need:,} bytes" \
        if have < need else None


def _short(path: Path) -> str:
    """An entry's array by its own name (`shuffle_index.npy`), without the entry's."""
    return path.name.rsplit("-", 1)[-1]


def _stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_ino, st.st_size, st.st_ctime_ns]


_BUFFERS = threading.local()  # one reusable read buffer per hashing thread


def _crc_chunk(path: Path, offset: int) -> int:
    """CRC-32 of `CHUNK_BYTES` of the file from `offset`, read into this thread's buffer in 8 MiB pieces (zlib
    releases the GIL: chunks are hashed in parallel)."""
    buf = getattr(_BUFFERS, "buf", None)
    if buf is None:
        buf = _BUFFERS.buf = bytearray(8 << 20)
    view, crc, done = memoryview(buf), 0, 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while done < CHUNK_BYTES and (n := f.readinto(view[: min(len(buf), CHUNK_BYTES - done)])):
            crc, done = zlib.crc32(view[:n], crc), done + n
    return crc


def _digests(paths: list[Path], known: dict | None = None) -> dict[str, dict]:
    """{file name: {"size", "crc32": [one per CHUNK_BYTES], "stamp"}} of `paths`, every chunk of every file hashed
    on a pool of threads; a file whose stamp (inode, size, ctime) is the one `known` records for it keeps `known`'s
    CRCs without being read."""
    out, jobs = {}, []
    for p in paths:
        stamp = _stamp(p)
        old = (known or {}).get(p.name)
        if isinstance(old, dict) and old.get("stamp") == stamp and isinstance(old.get("crc32"), list):
            out[p.name] = old
        else:
            out[p.name] = {"size": stamp[1], "crc32": None, "stamp": stamp}
            jobs += [(p, offset) for offset in range(0, max(stamp[1], 1), CHUNK_BYTES)]
    with ThreadPoolExecutor(min(HASH_THREADS, max(1, len(jobs)))) as pool:
        crcs = list(pool.map(lambda job: _crc_chunk(*job), jobs))
    for (p, _offset), crc in zip(jobs, crcs):
        out[p.name]["crc32"] = [*(out[p.name]["crc32"] or []), crc]
    return out


def _hex(value) -> str:
    if isinstance(value, list):
        return " ".join(f"{v:08x}" for v in value[:2]) + (" …" if len(value) > 2 else "")
    return repr(value)


def _write_digests(desc: Path, digests: dict[str, dict]) -> None:
    from pretrain.files import write_atomic

    write_atomic(desc.with_name(desc.name[: -len(DESCRIPTION)] + DIGESTS),
                 json.dumps({"format": DIGEST_FORMAT, "arrays": digests}), durable=False)


def _digest_mismatch(desc: Path, paths: list[Path]) -> str | None:
    """Why the arrays do not match the digests recorded when they were written (None: they match; the record's
    stamps are refreshed)."""
    path = desc.with_name(desc.name[: -len(DESCRIPTION)] + DIGESTS)
    try:
        record = json.loads(path.read_text())
        known = record["arrays"] if record.get("format") == DIGEST_FORMAT else None
        if not isinstance(known, dict):
            raise ValueError("not a digest record")
    except FileNotFoundError:
        return "no digest recorded (written by another program, or by a start stopped before recording it)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"its digest record {path.name} is unreadable"
    now = _digests(paths, known)
    for p in paths:
        want = known.get(p.name) if isinstance(known.get(p.name), dict) else {}
        have = now[p.name]
        if (have["size"], have["crc32"]) != (want.get("size"), want.get("crc32")):
            size = want.get("size")
            return (f"{_short(p)} does not match the digest recorded when it was written: CRC-32 "
                    f"{_hex(have['crc32'])} over {have['size']:,} bytes, recorded {_hex(want.get('crc32'))} over "
                    f"{f'{size:,}' if isinstance(size, int) else size} bytes")
    if now != known:
        try:
            _write_digests(desc, now)  # the new stamps (a copied cache dir): not read again next time
        except OSError:
            pass
    return None


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


def _entries(cache_dir: str | os.PathLike):
    """(description, kind, array paths) of every entry whose arrays all exist."""
    for desc in sorted(Path(cache_dir).glob(f"*{DESCRIPTION}")):
        base = desc.name[: -len(DESCRIPTION)]
        parts = base.split("-")
        arrays = ARRAYS.get(parts[1]) if len(parts) >= 3 else None
        paths = [desc.with_name(f"{base}-{a}") for a in arrays or ()]
        if arrays is not None and all(p.is_file() for p in paths):
            yield desc, parts[1], paths


def check_entries(cache_dir: str | os.PathLike) -> list[str]:
    """Delete the entries whose arrays all exist but are truncated or unreadable, are not consistent indices, have
    no digest or do not match it (see the module); return `NAME (why)` for each (the build then rebuilds them)."""
    removed = []
    for desc, kind, paths in _entries(cache_dir):
        why = next((w for w in map(_incomplete, paths) if w), None)
        if why is None:
            try:
                why = _consistent(kind, {a: np.load(p, mmap_mode="r") for a, p in zip(ARRAYS[kind], paths)})
            except (OSError, ValueError) as exc:
                why = f"unreadable ({exc})"
            why = why and f"corrupt: {why}"
        if why is None:
            why = _digest_mismatch(desc, paths)
        if why is not None:
            base = desc.name[: -len(DESCRIPTION)]
            for p in (desc, *paths, desc.with_name(base + DIGESTS)):
                p.unlink(missing_ok=True)
            removed.append(f"{base} ({why})")
    return removed


remove_truncated = check_entries  # the earlier name


def record_digests(cache_dir: str | os.PathLike) -> int:
    """After a build (the building rank): write the digests of every complete entry that has none (those this
    build wrote). Returns how many were written; a cache that cannot be written is no error (those entries are
    rebuilt next time)."""
    written = 0
    for desc, _kind, paths in _entries(cache_dir):
        base = desc.name[: -len(DESCRIPTION)]
        if desc.with_name(base + DIGESTS).exists() or any(_incomplete(p) for p in paths):
            continue
        try:
            _write_digests(desc, _digests(paths))
            written += 1
        except OSError:
            continue
    return written
