"""A dataset checked as a whole: index header, version, dtype, pointers, ``.bin`` size and the counts of its
``PREFIX.meta.json``, with its largest token id. The trainer's pre-flight check and ``data_tools verify``
both use :func:`check_dataset`.

Two depths. The full check reads the whole ``.idx`` (lengths, pointers, document indices: ≈ 20 bytes per
document). The metadata check (``trust_metadata=True``, the trainer's) reads the ``.idx`` header, 128 KiB of it
for the fingerprint and the metadata: when ``PREFIX.meta.json`` records the pair's index facts (sizes and
fingerprint, written by ``preprocess`` and ``merge``) and they match, the metadata's counts and largest id stand
for the index; otherwise (older metadata, none, or facts that do not match) the full check runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from pretrain.dataset_format import verdicts
from pretrain.dataset_format.fingerprint import read_edges, recorded_facts
from pretrain.dataset_format.indexed import (
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
from pretrain.dataset_format.metadata import check_meta_matches, read_meta


@dataclass
class DatasetFacts:
    """A checked dataset: its index, its metadata (None without ``PREFIX.meta.json``) and its largest id."""

    prefix: str
    info: IndexInfo | IndexHeader  # the memory-mapped index; after a metadata check its header only
    meta: dict[str, Any] | None
    max_token_id: int | None  # None: empty, or not known (no metadata and the scan was skipped)
    max_id_from: str  # "metadata" | "scan" | "unchecked"
    checked: str = "full"  # "full": the whole .idx was read; "metadata": header + fingerprint + metadata;
    # "cache": header + sizes + the verdict an earlier full read left in the verdict cache (``verdicts``)
    why_full: str = ""  # with a full check under trust_metadata: why the metadata could not stand for the index
    stamps: dict[str, list[int]] | None = None  # a full check with a verdict cache: the files as they were read


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
                  trust_metadata: bool = False, verdict_cache: str | os.PathLike | None = None) -> DatasetFacts:
    """Check ``prefix`` (index header, version, dtype, pointers, ``.bin`` size, metadata counts).

    The largest token id comes from the metadata; without it the ``.bin`` is scanned in chunks when it is
    at most ``scan_limit_bytes`` (None: always). ``trust_metadata``: the metadata check where the metadata's
    index facts match (see the module). ``verdict_cache`` (a directory, ``verdicts``): where the metadata cannot
    stand for the index, a current verdict of an earlier full read stands for it; a full read records the files'
    stamps for a new entry. Raises ``IndexedFormatError`` / ``MetadataError`` (both ``ValueError``) naming the
    file.
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
    if info is None:
        if not bin_path(prefix).is_file() and idx_path(prefix).is_file():
            raise IndexedFormatError(f"{bin_path(prefix)}: data file not found (index {idx_path(prefix)} exists)")
        info = check_consistency(prefix)
        meta = read_meta(prefix)
        if meta is not None:
            check_meta_matches(prefix, meta, info)
    top, source = None, "unchecked"
    if meta is not None and meta.get("max_token_id") is not None:
        top, source = int(meta["max_token_id"]), "metadata"
    elif scan_limit_bytes is None or bin_path(prefix).stat().st_size <= scan_limit_bytes:
        top, source = max_token_id(prefix), "scan"  # None for an empty .bin
    return DatasetFacts(prefix, info, meta, top, source, "metadata" if not why_full and trust_metadata else "full",
                        why_full, stamps)
