"""Megatron-Core indexed dataset (``.bin``/``.idx``) format, written and read with numpy only.

The layout is the one ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` writes
(tests check byte equality against it)::

    b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q sequence count S | <Q document count D
    | int32[S] sequence lengths | int64[S] byte pointers | int64[D] document indices (first is 0)

Keeping this module free of torch/megatron imports keeps ``preprocess`` start-up fast.
"""

from __future__ import annotations

import glob
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pretrain.files import commit

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Megatron-Core's DType enum codes.
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_FIXED_HEADER = len(INDEX_HEADER) + 8 + 1 + 8 + 8
_COPY_CHUNK = 1 << 22


class IndexedFormatError(ValueError):
    """A ``.bin``/``.idx`` pair that is truncated, corrupt or inconsistent."""


def optimal_dtype(vocab_size: int | None) -> type[np.number]:
    """The token dtype Megatron uses for a vocabulary: uint16 below 65,500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def bin_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.bin``."""
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.idx``."""
    return Path(f"{os.fspath(prefix)}.idx")


def _header_bytes(dtype: np.dtype, sequence_count: int, document_count: int) -> bytes:
    return (
        INDEX_HEADER
        + struct.pack("<Q", INDEX_VERSION)
        + struct.pack("<B", CODE_OF_DTYPE[np.dtype(dtype)])
        + struct.pack("<Q", sequence_count)
        + struct.pack("<Q", document_count)
    )


def _copy_file(src: Path, dst: BinaryIO) -> None:
    with open(src, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            dst.write(chunk)


def write_index_streaming(
    path: Path,
    dtype: np.dtype,
    lengths_file: Path,
    doc_indices_file: Path,
    chunk_items: int = 1 << 20,
) -> None:
    """Write an ``.idx`` from spilled int32 lengths and int64 document indices, in bounded memory.

    ``doc_indices_file`` holds the document indices *after* the leading 0.
    """
    itemsize = np.dtype(dtype).itemsize
    n_seq = lengths_file.stat().st_size // 4
    n_doc = doc_indices_file.stat().st_size // 8 + 1
    with open(path, "wb") as out:
        out.write(_header_bytes(dtype, n_seq, n_doc))
        _copy_file(lengths_file, out)
        pointer = np.int64(0)
        with open(lengths_file, "rb") as f:
            while True:
                lengths = np.fromfile(f, dtype=np.int32, count=chunk_items)
                if lengths.size == 0:
                    break
                ends = np.cumsum(lengths.astype(np.int64) * itemsize) + pointer
                starts = np.empty_like(ends)
                starts[0] = pointer
                starts[1:] = ends[:-1]
                out.write(starts.tobytes())
                pointer = ends[-1]
        out.write(np.zeros(1, dtype=np.int64).tobytes())
        _copy_file(doc_indices_file, out)
        out.flush()
        os.fsync(out.fileno())


@dataclass
class IndexInfo:
    """The parsed ``.idx`` of a dataset (arrays are memory-mapped)."""

    dtype: np.dtype
    sequence_lengths: np.ndarray
    sequence_pointers: np.ndarray
    document_indices: np.ndarray

    @property
    def num_sequences(self) -> int:
        return int(self.sequence_lengths.size)

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def span(self, first: int, last: int) -> tuple[int, int, int]:
        """(pointer of sequence `first`, pointer of sequence `last`, length of `last`)."""
        return int(self.sequence_pointers[first]), int(self.sequence_pointers[last]), int(self.sequence_lengths[last])


def prefix_hint(prefix: str) -> str:
    """A hint for a dataset prefix with no files: the prefix given with an extension, or the ``preprocess``
    ``--output-prefix`` without its ``_KEY_document`` (empty when neither is there)."""
    for ext in (".bin", ".idx", ".meta.json"):
        if prefix.endswith(ext) and os.path.isfile(prefix[: -len(ext)] + ".idx"):
            return f" (did you mean {prefix[: -len(ext)]}? a prefix has no extension)"
    found = sorted(glob.glob(glob.escape(prefix) + "_*_document.idx"))
    if found:
        names = " or ".join(f[: -len(".idx")] for f in found[:3])
        return f" (did you mean {names}? preprocess adds _KEY_document to its --output-prefix)"
    return ""


@dataclass
class IndexHeader:
    """The fixed header of an ``.idx``, read without mapping the file: counts and dtype; single pointers and
    lengths are read on demand (:func:`tokens_between`)."""

    path: str
    dtype: np.dtype
    num_sequences: int
    num_documents: int

    def span(self, first: int, last: int) -> tuple[int, int, int]:
        """(pointer of sequence `first`, pointer of sequence `last`, length of `last`): one open, three reads."""
        with open(self.path, "rb") as f:
            def read(offset: int, fmt: str) -> int:
                f.seek(offset)
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

            pointers = _FIXED_HEADER + 4 * self.num_sequences
            return (read(pointers + 8 * first, "<q"), read(pointers + 8 * last, "<q"),
                    read(_FIXED_HEADER + 4 * last, "<i"))


def parse_header(path: str | os.PathLike, head: bytes, size: int) -> IndexHeader:
    """Check the first bytes ``head`` of the ``.idx`` at ``path`` (``size`` bytes long); raise
    :class:`IndexedFormatError` naming the file."""
    if len(head) < len(INDEX_HEADER) or head[: len(INDEX_HEADER)] != INDEX_HEADER:
        raise IndexedFormatError(f"{path}: not a Megatron indexed dataset index (bad magic header)")
    if len(head) < _FIXED_HEADER:
        raise IndexedFormatError(f"{path}: truncated header ({size} bytes)")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != INDEX_VERSION:
        raise IndexedFormatError(f"{path}: unsupported index version {version}")
    code = head[17]
    if code not in DTYPE_CODES:
        raise IndexedFormatError(f"{path}: unknown dtype code {code}")
    (n_seq,) = struct.unpack("<Q", head[18:26])
    (n_doc,) = struct.unpack("<Q", head[26:34])
    expected = _FIXED_HEADER + n_seq * (4 + 8) + n_doc * 8
    if n_doc < 1 or size < expected:
        raise IndexedFormatError(
            f"{path}: truncated or corrupt: header says {n_seq} sequences and {n_doc - 1} documents "
            f"({expected} bytes) but the file has {size} bytes"
        )
    if size != expected:
        raise IndexedFormatError(f"{path}: {size - expected} unexpected trailing bytes after the index")
    return IndexHeader(os.fspath(path), np.dtype(DTYPE_CODES[code]), int(n_seq), int(n_doc) - 1)


def read_index(prefix: str | os.PathLike) -> IndexInfo:
    """Parse and sanity-check ``PREFIX.idx``; raise :class:`IndexedFormatError` naming the file."""
    path = idx_path(prefix)
    if not path.is_file():
        raise IndexedFormatError(f"{path}: index file not found{prefix_hint(str(prefix))}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_FIXED_HEADER)
    header = parse_header(path, head, size)
    n_seq, n_doc = header.num_sequences, header.num_documents + 1
    mm = np.memmap(path, mode="r", dtype=np.uint8)
    offset = _FIXED_HEADER
    lengths = np.frombuffer(mm, dtype=np.int32, count=n_seq, offset=offset)
    offset += 4 * n_seq
    pointers = np.frombuffer(mm, dtype=np.int64, count=n_seq, offset=offset)
    offset += 8 * n_seq
    docs = np.frombuffer(mm, dtype=np.int64, count=n_doc, offset=offset)
    return IndexInfo(header.dtype, lengths, pointers, docs)


def check_consistency(prefix: str | os.PathLike, info: IndexInfo | None = None) -> IndexInfo:
    """Check the index's lengths, pointers and document indices against each other and the ``.bin`` size."""
    info = info or read_index(prefix)
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    if not bpath.is_file():
        raise IndexedFormatError(f"{bpath}: data file not found (index {ipath} exists)")
    itemsize = info.dtype.itemsize
    lengths = info.sequence_lengths
    if lengths.size and int(lengths.min()) < 0:
        raise IndexedFormatError(f"{ipath}: negative sequence length at sequence {int(np.argmin(lengths))}")
    expected_ptr = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=expected_ptr[1:])
    bad = np.flatnonzero(expected_ptr != info.sequence_pointers)
    if bad.size:
        raise IndexedFormatError(
            f"{ipath}: sequence pointer {int(bad[0])} is {int(info.sequence_pointers[bad[0]])}, "
            f"expected {int(expected_ptr[bad[0]])} from the lengths"
        )
    docs = info.document_indices
    if docs[0] != 0:
        raise IndexedFormatError(f"{ipath}: first document index is {int(docs[0])}, expected 0")
    if docs.size > 1 and (np.any(np.diff(docs) < 0) or docs[-1] != lengths.size):
        raise IndexedFormatError(
            f"{ipath}: document indices are not non-decreasing up to the sequence count {lengths.size}"
        )
    check_bin_size(prefix, info.num_tokens, info.dtype)
    return info


def check_bin_size(prefix: str | os.PathLike, num_tokens: int, dtype: np.dtype) -> None:
    """``PREFIX.bin`` holds exactly ``num_tokens`` tokens of ``dtype``; raise :class:`IndexedFormatError` if not."""
    bpath = bin_path(prefix)
    data_bytes = int(num_tokens) * np.dtype(dtype).itemsize
    actual = bpath.stat().st_size
    if actual != data_bytes:
        raise IndexedFormatError(
            f"{bpath}: {actual} bytes but the index describes {num_tokens} tokens of "
            f"{np.dtype(dtype).name} = {data_bytes} bytes ({'truncated' if actual < data_bytes else 'extra data'})"
        )


def tokens_between(info: IndexInfo | IndexHeader, beg: int, end: int) -> int:
    """Tokens of sequences ``[beg, end)`` (clipped to the index) from two pointers and a length, without reading
    the lengths in between (equal to ``sequence_lengths[beg:end].sum()`` for a consistent index)."""
    n = info.num_sequences
    beg, end = min(max(beg, 0), n), min(max(end, 0), n)
    if end <= beg:
        return 0
    first_pointer, last_pointer, last_length = info.span(beg, end - 1)
    return (last_pointer + last_length * info.dtype.itemsize - first_pointer) // info.dtype.itemsize


def find_token_outside(prefix: str | os.PathLike, vocab_size: int, chunk: int = 1 << 24) -> tuple[int, int] | None:
    """``(position, id)`` of the first token of ``PREFIX.bin`` outside ``[0, vocab_size)``, or None.

    Reads the memory-mapped file in chunks of ``chunk`` tokens (bounded memory on any size).
    """
    tokens = read_tokens(prefix)
    for start in range(0, tokens.size, chunk):
        part = np.asarray(tokens[start : start + chunk]).astype(np.int64)
        bad = np.flatnonzero((part >= vocab_size) | (part < 0))
        if bad.size:
            return start + int(bad[0]), int(part[bad[0]])
    return None


def max_token_id(prefix: str | os.PathLike, chunk: int = 1 << 24) -> int | None:
    """The largest token id in ``PREFIX.bin`` (chunked scan), None for an empty dataset."""
    tokens = read_tokens(prefix)
    top = None
    for start in range(0, tokens.size, chunk):
        m = int(np.asarray(tokens[start : start + chunk]).max())
        top = m if top is None else max(top, m)
    return top


def read_tokens(prefix: str | os.PathLike) -> np.ndarray:
    """Memory-map the whole ``.bin`` of ``prefix`` with its index dtype."""
    info = read_index(prefix)
    path = bin_path(prefix)
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=info.dtype)
    return np.memmap(path, mode="r", dtype=info.dtype)


class IndexedWriter:
    """Streams token batches to ``PREFIX.bin`` and spills the index arrays to side files.

    All files are temporaries next to the output; :meth:`finalize` writes the ``.idx`` and renames
    ``.bin`` then ``.idx`` into place, so a final ``.idx`` only ever appears for a complete dataset.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: type[np.number], resume_sizes: dict | None = None):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        self.tmp_bin = Path(f"{self.prefix}.bin.tmp")
        self.tmp_lengths = Path(f"{self.prefix}.lengths.tmp")
        self.tmp_docs = Path(f"{self.prefix}.docs.tmp")
        files = (self.tmp_bin, self.tmp_lengths, self.tmp_docs)
        if resume_sizes is None:
            self._handles = [open(p, "wb") for p in files]
            self.num_tokens = self.num_sequences = self.num_documents = 0
        else:
            self._handles = []
            for p, key in zip(files, ("bin", "lengths", "docs")):
                want = int(resume_sizes[key])
                if not p.is_file() or p.stat().st_size < want:
                    raise IndexedFormatError(f"{p}: shorter than the resume state records; re-run without --resume")
                h = open(p, "r+b")
                h.truncate(want)
                h.seek(want)
                self._handles.append(h)
            self.num_tokens = int(resume_sizes["bin"]) // self.dtype.itemsize
            self.num_sequences = int(resume_sizes["lengths"]) // 4
            self.num_documents = int(resume_sizes["docs"]) // 8

    def add_batch(self, tokens: np.ndarray, sequence_lengths: np.ndarray, sequences_per_doc: np.ndarray) -> None:
        """Append documents: flat ``tokens``, the length of each sequence, the sequence count of each doc."""
        bin_f, len_f, doc_f = self._handles
        bin_f.write(memoryview(np.ascontiguousarray(tokens, dtype=self.dtype)).cast("B"))
        len_f.write(memoryview(np.ascontiguousarray(sequence_lengths, dtype=np.int32)).cast("B"))
        doc_ends = np.cumsum(sequences_per_doc, dtype=np.int64) + self.num_sequences
        doc_f.write(memoryview(doc_ends).cast("B"))
        self.num_tokens += int(tokens.size)
        self.num_sequences += int(sequence_lengths.size)
        self.num_documents += int(sequences_per_doc.size)

    def flush(self) -> dict[str, int]:
        """Flush the temporaries; return their sizes (the resume point)."""
        for h in self._handles:
            h.flush()
        return {
            "bin": self._handles[0].tell(),
            "lengths": self._handles[1].tell(),
            "docs": self._handles[2].tell(),
        }

    def close(self) -> None:
        """Close the temporaries. Errors are ignored: this runs on failure paths (e.g. a full disk,
        where flushing the last buffer fails again) and must not mask the original error;
        :meth:`finalize` flushes and syncs explicitly before it closes."""
        for h in self._handles:
            try:
                h.close()
            except OSError:
                pass

    def finalize(self) -> None:
        """Write the ``.idx`` and move both files into place (``.idx`` last)."""
        self.prepare()
        self.commit()

    def prepare(self) -> None:
        """Sync the ``.bin`` temporary and write the ``.idx`` temporary (the step that can fail)."""
        bin_f = self._handles[0]
        self.flush()
        os.fsync(bin_f.fileno())
        self.close()
        write_index_streaming(Path(f"{self.prefix}.idx.tmp"), self.dtype, self.tmp_lengths, self.tmp_docs)

    def commit(self) -> None:
        """Rename the prepared temporaries into place (``.bin`` then ``.idx``)."""
        final_idx, final_bin = idx_path(self.prefix), bin_path(self.prefix)
        final_idx.unlink(missing_ok=True)  # never leave an old index next to a new .bin
        commit(self.tmp_bin, final_bin)
        commit(Path(f"{self.prefix}.idx.tmp"), final_idx)
        self.tmp_lengths.unlink(missing_ok=True)
        self.tmp_docs.unlink(missing_ok=True)

    def discard(self) -> None:
        """Close and delete every temporary."""
        self.close()
        for p in (self.tmp_bin, self.tmp_lengths, self.tmp_docs, Path(f"{self.prefix}.idx.tmp")):
            p.unlink(missing_ok=True)
