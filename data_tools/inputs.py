"""Streaming corpus readers: JSONL (plain, .gz, .zst) and Parquet, in bounded-size batches.

JSONL chunks are parsed with pyarrow's multi-threaded JSON reader; a chunk it rejects (or one with blank
lines, missing values or invalid UTF-8) is re-parsed line by line with ``json`` so every bad line is reported
with its file and line number. pyarrow's JSON reader does *not* check UTF-8 (it copies invalid bytes into the
string column, and gigatoken crashes on them), so every :class:`TextColumn` is validated when it is made and a
chunk with invalid bytes takes the exact path. Parquet string columns are validated the same way, row by row
when one is invalid. What a file really is (magic bytes) and its decompression, with a cut or corrupt stream
refused, are in :mod:`data_tools.formats`. Texts of a clean chunk stay in Arrow memory (:class:`TextColumn`):
the fast encoder reads them without building Python strings.
"""

from __future__ import annotations

import glob
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data_tools.formats import JSONL_SUFFIXES, PARQUET_SUFFIXES, Decompressed, InputError, check_format

__all__ = ["JSONL_SUFFIXES", "PARQUET_SUFFIXES", "Batch", "InputError", "TextColumn", "as_text_list", "expand_inputs",
           "read_batches"]
_BOM = b"\xef\xbb\xbf"


class TextColumn:
    """The strings of one JSON key in a batch, kept in Arrow memory (a ``large_string`` array).

    Behaves as a read-only sequence of ``str``; :meth:`awkward` is a zero-copy view that
    gigatoken encodes directly, :meth:`to_list` materialises Python strings (reference encoders).
    Made only from valid UTF-8 (``pyarrow.ArrowInvalid`` otherwise): no encoder ever sees invalid bytes.
    """

    def __init__(self, array: Any) -> None:
        array.validate(full=True)  # UTF-8 of every string (SIMD; ~1 ms per 8 MB)
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


def invalid_utf8_rows(array: Any, column: str) -> list[tuple[int, str]]:
    """(row, reason) of the strings of an Arrow string array (Parquet ``column``) that are not valid UTF-8."""
    import pyarrow as pa

    out = []
    for i, raw in enumerate(array.cast(pa.large_binary()).to_pylist()):
        if raw is None:
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            out.append((i, f"invalid UTF-8 (column {column!r}: byte 0x{raw[e.start]:02x} at byte {e.start + 1})"))
    return out


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
            check_format(p)  # a .jsonl that is gzip/Parquet/..., or a .gz that is not: one line naming it
            key = p.resolve()
            if key not in seen:
                seen.add(key)
                out.append(p)
    return out


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

    pyarrow rejects lone surrogate escapes but copies invalid UTF-8 bytes into the strings: :class:`TextColumn`
    refuses those, and the chunk then takes the exact path (which names each bad line).
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
        try:
            cols[k] = TextColumn(col.combine_chunks())
        except pa.ArrowInvalid:  # invalid UTF-8
            return None
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


def _parse_chunk(chunk: bytes, n_lines: int, line_no: int, parser: _Parser, path: Path,
                 on_bad: Callable[[Path, int, str], None] | None) -> tuple[dict, dict, list[int], list]:
    """(texts, seqs per doc, line numbers, skipped) of one chunk of whole lines."""
    keys = parser.keys
    fast = _arrow_chunk(chunk, keys, n_lines)
    if fast is not None:
        return fast, dict.fromkeys(keys), list(range(line_no + 1, line_no + n_lines + 1)), []
    texts: dict[str, Any] = {}
    seqs: dict[str, list[int] | None] = {}
    lines: list[int] = []
    skipped: list[tuple[int, str]] = []
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
    return texts, seqs, lines, skipped


def _skip_to(stream: Decompressed, skip_bytes: int) -> None:
    """Position ``stream`` at decompressed byte ``skip_bytes`` (a resume point)."""
    if stream.seekable:
        stream.seek(skip_bytes)
        return
    left = skip_bytes
    while left:
        got = stream.read(min(left, 1 << 22))
        if not got:
            raise InputError(f"{stream.path}: shorter than the resume point; the input changed")
        left -= len(got)


def _jsonl_batches(
    fi: int,
    path: Path,
    parser: _Parser,
    batch_bytes: int,
    skip_records: int,
    skip_bytes: int,
    on_bad: Callable[[Path, int, str], None] | None,
) -> Iterator[Batch]:
    stream = Decompressed(path, check_format(path))
    try:
        pos = 0
        if skip_bytes:
            _skip_to(stream, skip_bytes)
            pos = skip_bytes
        line_no = skip_records
        carry = b""
        while True:
            data = stream.read(batch_bytes, after_line=line_no)
            if pos == 0 and not carry and data.startswith(_BOM):  # a UTF-8 byte-order mark is not part of line 1
                data, pos = data[len(_BOM):], len(_BOM)
            eof = not data
            buf = carry + data
            unterminated = False
            if eof:
                if not buf:
                    break
                if not buf.endswith(b"\n"):
                    buf += b"\n"
                    pos -= 1  # the synthetic newline is not in the file
                    unterminated = True
                chunk, carry = buf, b""
            else:
                cut = buf.rfind(b"\n")
                if cut < 0:
                    carry = buf
                    continue
                chunk, carry = buf[: cut + 1], buf[cut + 1 :]
            n_lines = chunk.count(b"\n")
            texts, seqs, lines, skipped = _parse_chunk(chunk, n_lines, line_no, parser, path, on_bad)
            line_no += n_lines
            if unterminated and skipped and skipped[-1][0] == line_no and skipped[-1][1].startswith("malformed"):
                # A file cut in the middle of a line (a partial download or copy) is refused, never shortened.
                raise InputError(f"{path}:{line_no}: the file ends inside this line (no final newline, not valid "
                                 "JSON): truncated? re-download or re-copy it")
            pos += len(chunk)
            yield Batch(fi, texts, seqs, lines, line_no, pos, text_bytes=len(chunk),
                        progress_bytes=pos if stream.seekable else stream.disk_pos(), skipped=skipped)
            if eof:
                break
    finally:
        stream.close()


def _parquet_file(path: Path, keys: list[str]) -> Any:
    """An opened ``pyarrow.parquet.ParquetFile`` whose ``keys`` are string columns (else :class:`InputError`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file, truncated or corrupt ({e})") from e
    names = pf.schema_arrow.names
    for k in keys:
        if k not in names:
            raise InputError(f"{path}: no column {k!r} (columns: {', '.join(names)})")
        t = pf.schema_arrow.field(k).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
            raise InputError(f"{path}: column {k!r} is {t}, expected a string column")
    return pf


def _row_group_batches(pf: Any, path: Path, rg: int, keys: list[str], batch_rows: int, row: int) -> Iterator[Any]:
    """The record batches of row group ``rg`` (its first row is file row ``row + 1``); a corrupt or short row
    group is an :class:`InputError` naming it."""
    import pyarrow as pa

    expected, got = pf.metadata.row_group(rg).num_rows, 0
    where = (f"{path}: row group {rg} (of {pf.metadata.num_row_groups}; rows {row + 1:,}-{row + expected:,} of the "
             "file)")
    it = pf.iter_batches(batch_size=batch_rows, row_groups=[rg], columns=keys)
    while True:
        try:
            rb = next(it)
        except StopIteration:
            break
        except (pa.ArrowException, OSError, EOFError) as e:
            raise InputError(f"{where} cannot be read from row {row + got + 1:,}: the file is corrupt ({e})") from e
        got += rb.num_rows
        yield rb
    if got != expected:
        raise InputError(f"{where} holds {got:,} rows, its metadata says {expected:,}: the file is corrupt")


def _parquet_rows(rb: Any, keys: list[str], lo: int, first_row: int, path: Path,
                  on_bad: Callable[[Path, int, str], None] | None) -> tuple[dict, list[int], list, int]:
    """(texts, row numbers, skipped, text bytes) of rows ``lo:`` of a record batch (null or invalid UTF-8 rows
    skipped; ``first_row``: the file row number of the batch's row 0, 1-based)."""
    import pyarrow as pa

    bad: dict[int, str] = {}
    arrays = {}
    for k in keys:
        arr = rb.column(k).slice(lo)
        try:
            arr.validate(full=True)
        except pa.ArrowInvalid:
            for i, why in invalid_utf8_rows(arr, k):
                bad.setdefault(i, why)
            arr = pa.array([None if i in bad else v for i, v in enumerate(
                arr.cast(pa.large_binary()).to_pylist())], pa.large_binary()).cast(pa.large_string())
        for i in np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)).tolist():
            bad.setdefault(i, f"column {k!r} is null")
        arrays[k] = arr.to_pylist()
    texts: dict[str, list[str]] = {k: [] for k in keys}
    lines: list[int] = []
    skipped: list[tuple[int, str]] = []
    nbytes = 0
    for j in range(rb.num_rows - lo):
        row = first_row + lo + j
        if j in bad:
            skipped.append((row, bad[j]))
            if on_bad is not None:
                on_bad(path, row, bad[j])
            continue
        lines.append(row)
        for k in keys:
            texts[k].append(arrays[k][j])
            nbytes += len(arrays[k][j])
    return texts, lines, skipped, nbytes


def _parquet_batches(
    fi: int,
    path: Path,
    keys: list[str],
    batch_bytes: int,
    skip_records: int,
    on_bad: Callable[[Path, int, str], None] | None,
) -> Iterator[Batch]:
    pf = _parquet_file(path, keys)
    meta = pf.metadata
    avg = max(1, (meta.serialized_size + sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))))
    batch_rows = min(65536, max(1, int(batch_bytes * max(1, meta.num_rows) / avg)))
    row = 0
    size = path.stat().st_size
    for rg in range(meta.num_row_groups):
        if row + meta.row_group(rg).num_rows <= skip_records:  # resumed past this row group: not read
            row += meta.row_group(rg).num_rows
            continue
        for rb in _row_group_batches(pf, path, rg, keys, batch_rows, row):
            n = rb.num_rows
            if row + n <= skip_records:
                row += n
                continue
            texts, lines, skipped, nbytes = _parquet_rows(rb, keys, max(0, skip_records - row), row + 1, path, on_bad)
            row += n
            yield Batch(fi, texts, dict.fromkeys(keys), lines, row, 0, text_bytes=nbytes,
                        progress_bytes=int(size * row / max(1, meta.num_rows)), skipped=skipped)
