"""Streaming corpus readers: JSONL (plain, .gz, .zst) and Parquet, in bounded-size batches.

JSONL chunks are parsed with pyarrow's multi-threaded JSON reader; a chunk it rejects (or one
with blank lines or missing values) is re-parsed line by line with ``json`` so every bad line is
reported with its file and line number. pyarrow's parser rejects invalid surrogate escapes (a lone
``\\ud800``) itself, so such chunks take the exact path too. Texts of a clean chunk stay in Arrow
memory (:class:`TextColumn`): the fast encoder reads them without building Python strings.
"""

from __future__ import annotations

import glob
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".jsonl.zstd")
PARQUET_SUFFIXES = (".parquet",)


class InputError(ValueError):
    """Unusable input: the message names the file (and line, where there is one)."""


class TextColumn:
    """The strings of one JSON key in a batch, kept in Arrow memory (a ``large_string`` array).

    Behaves as a read-only sequence of ``str``; :meth:`awkward` is a zero-copy view that
    gigatoken encodes directly, :meth:`to_list` materialises Python strings (reference encoders).
    """

    def __init__(self, array: Any) -> None:
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i: int) -> str:
        return self.array[i].as_py()

    def to_list(self) -> list[str]:
        return self.array.to_pylist()

    def awkward(self) -> Any:
        import awkward as ak

        arr = self.array
        _, off, data = arr.buffers()
        offsets = np.frombuffer(off, dtype=np.int64, count=len(arr) + 1, offset=arr.offset * 8)
        content = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
        layout = ak.contents.ListOffsetArray(
            ak.index.Index64(offsets),
            ak.contents.NumpyArray(content, parameters={"__array__": "char"}),
            parameters={"__array__": "string"},
        )
        return ak.Array(layout)

    def rows_containing(self, needles: tuple[str, ...]) -> list[int]:
        """Indices of the strings that contain any of ``needles``."""
        import pyarrow.compute as pc

        if not needles or not len(self.array):
            return []
        hit = pc.match_substring_regex(self.array, "|".join(_re_escape(n) for n in needles))
        return np.flatnonzero(hit.to_numpy(zero_copy_only=False)).tolist()


def _re_escape(s: str) -> str:
    import re

    return re.escape(s)


def as_text_list(texts: Any) -> list[str]:
    """``texts`` (a list of ``str`` or a :class:`TextColumn`) as a list of ``str``."""
    return texts.to_list() if isinstance(texts, TextColumn) else list(texts)


@dataclass
class Batch:
    """Documents read from one file: per JSON key, flat texts and the sequence count per document."""

    file_index: int
    texts: dict[str, Any]  # per key: list[str] or TextColumn (a sequence of str)
    seqs_per_doc: dict[str, list[int] | None]
    lines: list[int]  # line (or row) number of each document, 1-based
    records_done: int  # lines/rows of this file consumed after this batch
    byte_offset: int  # bytes of the (decompressed) stream consumed after this batch
    text_bytes: int = 0
    progress_bytes: int = 0  # on-disk bytes of this file consumed (for the progress bar)
    skipped: list[tuple[int, str]] = field(default_factory=list)


def _supported(p: Path) -> bool:
    name = p.name.lower()
    return name.endswith(JSONL_SUFFIXES) or name.endswith(PARQUET_SUFFIXES)


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files, directories (recursive) and globs -> a deterministic, de-duplicated list of files."""
    out: list[Path] = []
    seen: set[Path] = set()
    for spec in inputs:
        if any(ch in spec for ch in "*?["):
            found = [Path(p) for p in sorted(glob.glob(spec, recursive=True)) if Path(p).is_file()]
            if not found:
                raise InputError(f"{spec}: glob matched no files")
        elif Path(spec).is_dir():
            found = sorted((p for p in Path(spec).rglob("*") if p.is_file() and _supported(p)), key=str)
            if not found:
                raise InputError(f"{spec}: directory holds no .jsonl/.json(.gz/.zst)/.parquet files")
        elif Path(spec).exists():
            found = [Path(spec)]
        else:
            raise InputError(f"{spec}: input not found")
        for p in found:
            if not _supported(p):
                raise InputError(f"{p}: unsupported input type (use .jsonl, .json, .jsonl.gz, .jsonl.zst or .parquet)")
            if not os.access(p, os.R_OK):
                raise InputError(f"{p}: not readable")
            key = p.resolve()
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


class _CountingReader(io.RawIOBase):
    """Wraps a raw file to expose how many on-disk bytes were read (progress for compressed input)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        return self.f.readinto(b)  # type: ignore[attr-defined]

    def disk_pos(self) -> int:
        return self.f.tell()


def _open_stream(path: Path) -> tuple[BinaryIO, Any, bool]:
    """Return (decompressed stream, raw file, seekable)."""
    raw = open(path, "rb")
    name = path.name.lower()
    if name.endswith(".gz"):
        import gzip

        return gzip.GzipFile(fileobj=raw, mode="rb"), raw, False  # type: ignore[return-value]
    if name.endswith((".zst", ".zstd")):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw), raw, False
    return raw, raw, True


class _Parser:
    """Turns one JSON document into per-key values, or a reason it is skipped."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def parse_line(self, raw: bytes) -> tuple[dict[str, list[str]] | None, str | None]:
        if not raw.strip():
            return None, "blank line"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            return None, f"malformed JSON ({e.msg} at column {e.colno})"
        if not isinstance(obj, dict):
            return None, f"not a JSON object ({type(obj).__name__})"
        return self.values(obj)

    def values(self, obj: dict) -> tuple[dict[str, list[str]] | None, str | None]:
        out: dict[str, list[str]] = {}
        for key in self.keys:
            if key not in obj:
                return None, f"missing key {key!r}"
            v = obj[key]
            if isinstance(v, str):
                out[key] = [v]
            elif isinstance(v, list) and all(isinstance(s, str) for s in v):
                out[key] = v
            elif v is None:
                return None, f"key {key!r} is null"
            else:
                return None, f"key {key!r} is {type(v).__name__}, expected a string"
            for s in out[key]:
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError:
                    return None, f"key {key!r} holds an unpaired surrogate escape"
        return out, None


def _arrow_chunk(chunk: bytes, keys: list[str], n_lines: int) -> dict[str, TextColumn] | None:
    """Fast path: the chunk's per-key strings if every line is a clean object with string keys.

    pyarrow rejects lone surrogate escapes and invalid UTF-8 (the chunk then takes the exact path).
    """
    import pyarrow as pa
    import pyarrow.json as pj

    try:
        table = pj.read_json(
            io.BytesIO(chunk),
            # One block on the reader thread: the least CPU (the tokenizer needs the cores), and one
            # thread parses ~400 MB/s, far ahead of any tokenizer.
            read_options=pj.ReadOptions(use_threads=False, block_size=max(1 << 20, len(chunk))),
            parse_options=pj.ParseOptions(
                explicit_schema=pa.schema([(k, pa.large_string()) for k in keys]),
                unexpected_field_behavior="ignore",
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError, ValueError):
        return None
    if table.num_rows != n_lines:
        return None
    cols = {}
    for k in keys:
        col = table.column(k)
        if col.null_count:
            return None
        cols[k] = TextColumn(col.combine_chunks())
    return cols


def read_batches(
    files: list[Path],
    keys: list[str],
    batch_bytes: int = 8 << 20,
    start: tuple[int, int, int] = (0, 0, 0),
    on_bad: Callable[[Path, int, str], None] | None = None,
) -> Iterator[Batch]:
    """Yield batches of documents from ``files`` in order, starting at ``(file, records, bytes)``.

    ``on_bad(path, line, reason)`` is called for each skipped line (it may raise to stop).
    """
    parser = _Parser(keys)
    first_file, first_records, first_bytes = start
    for fi in range(first_file, len(files)):
        path = files[fi]
        skip_records = first_records if fi == first_file else 0
        skip_bytes = first_bytes if fi == first_file else 0
        if path.name.lower().endswith(PARQUET_SUFFIXES):
            yield from _parquet_batches(fi, path, keys, batch_bytes, skip_records, on_bad)
        else:
            yield from _jsonl_batches(fi, path, parser, batch_bytes, skip_records, skip_bytes, on_bad)


def _jsonl_batches(
    fi: int,
    path: Path,
    parser: _Parser,
    batch_bytes: int,
    skip_records: int,
    skip_bytes: int,
    on_bad: Callable[[Path, int, str], None] | None,
) -> Iterator[Batch]:
    stream, raw, seekable = _open_stream(path)
    keys = parser.keys
    try:
        pos = 0
        if skip_bytes:
            if seekable:
                stream.seek(skip_bytes)
            else:
                left = skip_bytes
                while left:
                    got = stream.read(min(left, 1 << 22))
                    if not got:
                        raise InputError(f"{path}: shorter than the resume point; the input changed")
                    left -= len(got)
            pos = skip_bytes
        line_no = skip_records
        carry = b""
        while True:
            try:
                data = stream.read(batch_bytes)
            except (OSError, EOFError, Exception) as e:  # gzip/zstd corruption
                if isinstance(e, InputError):
                    raise
                raise InputError(f"{path}: cannot decompress/read after line {line_no} ({e})") from e
            eof = not data
            buf = carry + data
            if eof:
                if not buf:
                    break
                if not buf.endswith(b"\n"):
                    buf += b"\n"
                    pos -= 1  # the synthetic newline is not in the file
                chunk, carry = buf, b""
            else:
                cut = buf.rfind(b"\n")
                if cut < 0:
                    carry = buf
                    continue
                chunk, carry = buf[: cut + 1], buf[cut + 1 :]
            n_lines = chunk.count(b"\n")
            texts: dict[str, Any] = {k: [] for k in keys}
            seqs: dict[str, list[int] | None] = {k: None for k in keys}
            lines: list[int] = []
            skipped: list[tuple[int, str]] = []
            fast = _arrow_chunk(chunk, keys, n_lines)
            if fast is not None:
                texts = fast
                lines = list(range(line_no + 1, line_no + n_lines + 1))
            else:
                multi = False
                per_doc: dict[str, list[list[str]]] = {k: [] for k in keys}
                for j, raw_line in enumerate(chunk.split(b"\n")[:n_lines]):
                    vals, reason = parser.parse_line(raw_line)
                    if vals is None:
                        skipped.append((line_no + j + 1, reason or "bad line"))
                        if on_bad is not None:
                            on_bad(path, line_no + j + 1, reason or "bad line")
                        continue
                    lines.append(line_no + j + 1)
                    for k in keys:
                        per_doc[k].append(vals[k])
                        multi = multi or len(vals[k]) != 1
                for k in keys:
                    texts[k] = [s for doc in per_doc[k] for s in doc]
                    seqs[k] = [len(doc) for doc in per_doc[k]] if multi else None
            line_no += n_lines
            pos += len(chunk)
            disk = raw.tell() if not seekable else pos
            yield Batch(
                fi,
                texts,
                seqs,
                lines,
                line_no,
                pos,
                text_bytes=len(chunk),
                progress_bytes=disk,
                skipped=skipped,
            )
            if eof:
                break
    finally:
        stream.close()
        raw.close()


def _parquet_batches(
    fi: int,
    path: Path,
    keys: list[str],
    batch_bytes: int,
    skip_records: int,
    on_bad: Callable[[Path, int, str], None] | None,
) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})") from e
    names = pf.schema_arrow.names
    for k in keys:
        if k not in names:
            raise InputError(f"{path}: no column {k!r} (columns: {', '.join(names)})")
        t = pf.schema_arrow.field(k).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise InputError(f"{path}: column {k!r} is {t}, expected a string column")
    meta = pf.metadata
    avg = max(1, (meta.serialized_size + sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))))
    rows_per_batch = max(1, int(batch_bytes * max(1, meta.num_rows) / avg))
    row = 0
    size = path.stat().st_size
    for rb in pf.iter_batches(batch_size=min(rows_per_batch, 65536), columns=keys):
        n = rb.num_rows
        if row + n <= skip_records:
            row += n
            continue
        lo = max(0, skip_records - row)
        cols = {k: rb.column(k).to_pylist()[lo:] for k in keys}
        texts: dict[str, list[str]] = {k: [] for k in keys}
        lines: list[int] = []
        skipped: list[tuple[int, str]] = []
        nbytes = 0
        for j in range(n - lo):
            bad = next((k for k in keys if cols[k][j] is None), None)
            if bad is not None:
                reason = f"column {bad!r} is null"
                skipped.append((row + lo + j + 1, reason))
                if on_bad is not None:
                    on_bad(path, row + lo + j + 1, reason)
                continue
            lines.append(row + lo + j + 1)
            for k in keys:
                texts[k].append(cols[k][j])
                nbytes += len(cols[k][j])
        row += n
        yield Batch(
            fi,
            texts,
            {k: None for k in keys},
            lines,
            row,
            0,
            text_bytes=nbytes,
            progress_bytes=int(size * row / max(1, meta.num_rows)),
            skipped=skipped,
        )
