"""A dataset checked as a whole: index header, version, dtype, pointers, ``.bin`` size and the counts of its
``PREFIX.meta.json``, with its largest token id. The trainer's pre-flight check and ``data_tools verify``
both use :func:`check_dataset`.

Three depths. The full check reads the whole ``.idx`` (lengths, pointers, document indices: ≈ 20 bytes per
document). The metadata check (``trust_metadata=True``, the trainer's) reads the ``.idx`` header, 128 KiB of it
for the fingerprint and the metadata: when ``PREFIX.meta.json`` records the pair's index facts (sizes and
fingerprint, written by ``preprocess`` and ``merge``) and they match, the metadata's counts and largest id stand
for the index; otherwise (older metadata, none, or facts that do not match) the full check runs, or, with
``header_only=True`` (``validate``'s), the header check: the header (magic, version, dtype, counts, the exact
``.idx`` size they imply), the first pointer and document index, the last pointer and length against the ``.bin``
size, the last document index against the sequence count, and the metadata's counts: a few reads at any size.
What only the full read finds (a wrong pointer or length inside the index, document indices out of order) is
found by the trainer's one-rank check before anything is read (it checks in full, once per file: its verdict is
cached) and by ``data_tools verify``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from pretrain.dataset_format import verdicts
from pretrain.dataset_format.fingerprint import read_edges, recorded_facts
from pretrain.dataset_format.indexed import (
    _FIXED_HEADER,
    IndexedFormatError,
    IndexHeader,
    IndexInfo,
    bin_path,
    check_bin_size,
    check_consistency,
    idx_path,
    max_token_id,
    parse_header,
)
from pretrain.dataset_format.metadata import check_meta_matches, read_meta, record_tokenizer


@dataclass
class DatasetFacts:
    """A checked dataset: its index, its metadata (None without ``PREFIX.meta.json``) and its largest id."""

    prefix: str
    info: IndexInfo | IndexHeader  # the memory-mapped index; after a metadata check its header only
    meta: dict[str, Any] | None
    max_token_id: int | None  # None: empty, or not known (no metadata and the scan was skipped)
    max_id_from: str  # "metadata" | "scan" | "unchecked"
    checked: str = "full"  # "full": the whole .idx was read; "metadata": header + fingerprint + metadata;
    # "header": header + first and last pointers, lengths and document indices against the sizes (`_header_check`);
    # "cache": header + sizes + the verdict an earlier full read left in the verdict cache (``verdicts``)
    why_full: str = ""  # with a full check under trust_metadata: why the metadata could not stand for the index
    stamps: dict[str, list[int]] | None = None  # a full check with a verdict cache: the files as they were read

    @property
    def tokenizer(self):
        """The `TokenizerIdentity` the metadata records as the dataset's tokenizer; None without metadata."""
        return record_tokenizer(self.meta) if self.meta is not None else None


def full_read_note(checked: list[DatasetFacts]) -> str | None:
    """One note for the datasets of `checked` whose metadata could not stand for their index (read in full), None
    when there is none."""
    full = [(f.prefix, f.why_full) for f in checked if f.checked == "full" and f.meta is not None]
    if not full:
        return None
    names = ", ".join(f"{p} ({why})" for p, why in full[:3]) + (f" and {len(full) - 3} more" if len(full) > 3 else "")
    return (f"{len(full)} dataset(s) were checked by reading their whole .idx because their .meta.json has no "
            f"index facts (written by an older data_tools) or facts that do not match: {names}; `python -m "
            "data_tools verify PREFIX --update-meta` records them, so later starts read only the header")


def _metadata_check(prefix: str) -> tuple[IndexHeader | None, dict[str, Any] | None, str]:
    """(header, metadata, "") when the metadata's index facts match the pair (one open and 128 KiB of the .idx,
    two stats, the metadata), else (None, metadata, why not). Raises for an unreadable header or metadata."""
    idx, data = f"{prefix}.idx", f"{prefix}.bin"
    try:
        idx_size, bin_size = os.stat(idx).st_size, os.stat(data).st_size
    except FileNotFoundError as e:
        exists = "" if e.filename == idx else f" (index {idx} exists)"
        raise IndexedFormatError(f"{e.filename}: {'index' if e.filename == idx else 'data'} file not found{exists}") \
            from None
    head, fingerprint = read_edges(idx, bin_size)
    header = parse_header(idx, head, idx_size)
    meta = read_meta(prefix)
    facts = recorded_facts(meta)
    if meta is None:
        return None, meta, "no metadata"
    if facts is None:
        return None, meta, "no index facts"
    if (header.num_documents, header.num_sequences) != (int(meta["documents"]), int(meta["sequences"])) \
            or meta.get("dtype") != header.dtype.name:
        return None, meta, "counts differ"
    if idx_size != facts["idx_bytes"]:
        return None, meta, "index size differs"
    if bin_size != facts["bin_bytes"]:
        return None, meta, "data size differs"
    if fingerprint != facts["fingerprint"]:
        return None, meta, "fingerprint differs"
    return header, meta, ""


def _header_check(prefix: str) -> tuple[IndexHeader, int]:
    """(header, tokens) of the pair from a few reads of the ``.idx``: the header and the exact size it implies, the
    first pointer and document index, the last pointer and length against the ``.bin`` size, the last document
    index against the sequence count. Raises ``IndexedFormatError`` naming the file."""
    import struct

    idx, size = idx_path(prefix), os.stat(idx_path(prefix)).st_size
    with open(idx, "rb") as f:
        header = parse_header(idx, f.read(_FIXED_HEADER), size)
        n, itemsize = header.num_sequences, header.dtype.itemsize
        docs_at = _FIXED_HEADER + 12 * n

        def read(offset: int, fmt: str) -> int:
            f.seek(offset)
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        first_doc, last_doc = read(docs_at, "<q"), read(docs_at + 8 * header.num_documents, "<q")
    if first_doc != 0:
        raise IndexedFormatError(f"{idx}: first document index is {first_doc}, expected 0")
    if header.num_documents and last_doc != n:
        raise IndexedFormatError(f"{idx}: the last document index is {last_doc}, expected the sequence count {n}")
    if not n:
        check_bin_size(prefix, 0, header.dtype)
        return header, 0
    first, last, length = header.span(0, n - 1)
    if first != 0:
        raise IndexedFormatError(f"{idx}: sequence pointer 0 is {first}, expected 0")
    if length < 0 or last < 0 or last % itemsize:
        raise IndexedFormatError(f"{idx}: the last sequence has pointer {last} and length {length}, not a position "
                                 f"in a {header.dtype.name} .bin")
    tokens = last // itemsize + length
    check_bin_size(prefix, tokens, header.dtype)
    return header, tokens


def _from_cache(prefix: str, verdict_cache: str | os.PathLike, scan_limit_bytes: int | None,
                why_full: str) -> DatasetFacts | None:
    """The facts of ``prefix`` from a current verdict-cache entry (``verdicts.lookup``), checked against its
    metadata's counts; None without one."""
    hit = verdicts.lookup(verdict_cache, prefix, scan_limit_bytes)
    if hit is None:
        return None
    header, meta = hit["header"], read_meta(prefix)
    top, source = hit["max_token_id"], hit["max_id_from"]
    if meta is not None:
        check_meta_matches(prefix, meta, SimpleNamespace(num_documents=header.num_documents, num_tokens=hit["tokens"],
                                                         num_sequences=header.num_sequences))
        if meta.get("max_token_id") is not None:
            top, source = int(meta["max_token_id"]), "metadata"
    return DatasetFacts(prefix, header, meta, top, source, "cache", why_full or "no metadata")


def check_dataset(prefix: str | os.PathLike, scan_limit_bytes: int | None = None,
                  trust_metadata: bool = False, verdict_cache: str | os.PathLike | None = None,
                  header_only: bool = False) -> DatasetFacts:
    """Check ``prefix`` (index header, version, dtype, pointers, ``.bin`` size, metadata counts).

    The largest token id comes from the metadata; without it the ``.bin`` is scanned in chunks when it is
    at most ``scan_limit_bytes`` (None: always). ``trust_metadata``: the metadata check where the metadata's
    index facts match (see the module). ``verdict_cache`` (a directory, ``verdicts``): where the metadata cannot
    stand for the index, a current verdict of an earlier full read stands for it; a full read records the files'
    stamps for a new entry. ``header_only`` (with ``trust_metadata``): where neither stands for the index, the
    header check (``_header_check``) instead of the full read. Raises ``IndexedFormatError`` / ``MetadataError``
    (both ``ValueError``) naming the file.
    """
    prefix = os.fspath(prefix)
    why_full, info, meta = "", None, None
    if trust_metadata:
        info, meta, why_full = _metadata_check(prefix)
        if info is not None:
            assert meta is not None
            check_bin_size(prefix, int(meta["tokens"]), info.dtype)
    stamps = None
    if info is None and verdict_cache is not None:
        cached = _from_cache(prefix, verdict_cache, scan_limit_bytes, why_full)
        if cached is not None:
            return cached
        stamps = verdicts.stamps(prefix)  # before the read: a file changed during it is re-read next time
    how = "metadata" if not why_full and trust_metadata else "full"
    if info is None:
        if not bin_path(prefix).is_file() and idx_path(prefix).is_file():
            raise IndexedFormatError(f"{bin_path(prefix)}: data file not found (index {idx_path(prefix)} exists)")
        if header_only and trust_metadata:
            info, tokens = _header_check(prefix)
            counted = SimpleNamespace(num_documents=info.num_documents, num_tokens=tokens,
                                      num_sequences=info.num_sequences)
            how, stamps = "header", None
        else:
            info = counted = check_consistency(prefix)
        meta = read_meta(prefix)
        if meta is not None:
            check_meta_matches(prefix, meta, counted)
    top, source = None, "unchecked"
    if meta is not None and meta.get("max_token_id") is not None:
        top, source = int(meta["max_token_id"]), "metadata"
    elif scan_limit_bytes is None or bin_path(prefix).stat().st_size <= scan_limit_bytes:
        top, source = max_token_id(prefix), "scan"  # None for an empty .bin
    return DatasetFacts(prefix, info, meta, top, source, how, why_full, stamps)
