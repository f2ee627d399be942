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
from typing import Any

from pretrain.dataset_format.fingerprint import index_fingerprint, recorded_facts
from pretrain.dataset_format.indexed import (
    IndexedFormatError,
    IndexInfo,
    bin_path,
    check_bin_size,
    check_consistency,
    idx_path,
    max_token_id,
    read_index,
)
from pretrain.dataset_format.metadata import check_meta_matches, read_meta


@dataclass
class DatasetFacts:
    """A checked dataset: its index, its metadata (None without ``PREFIX.meta.json``) and its largest id."""

    prefix: str
    info: IndexInfo  # memory-mapped: after a metadata check nothing past the header has been read
    meta: dict[str, Any] | None
    max_token_id: int | None  # None: empty, or not known (no metadata and the scan was skipped)
    max_id_from: str  # "metadata" | "scan" | "unchecked"
    checked: str = "full"  # "full": the whole .idx was read; "metadata": header + fingerprint + metadata
    why_full: str = ""  # with a full check under trust_metadata: why the metadata could not stand for the index


def _metadata_mismatch(prefix: str | os.PathLike, info: IndexInfo, meta: dict[str, Any] | None) -> str:
    """Why ``meta`` cannot stand for the index (empty string: it can)."""
    facts = recorded_facts(meta)
    if meta is None:
        return "no metadata"
    if facts is None:
        return "no index facts"
    idx_size, bin_size = idx_path(prefix).stat().st_size, bin_path(prefix).stat().st_size
    counts = (info.num_documents, info.num_sequences)
    if counts != (int(meta["documents"]), int(meta["sequences"])) or meta.get("dtype") != info.dtype.name:
        return "counts differ"
    if idx_size != facts["idx_bytes"]:
        return "index size differs"
    if bin_size != facts["bin_bytes"]:
        return "data size differs"
    if index_fingerprint(idx_path(prefix), bin_size) != facts["fingerprint"]:
        return "fingerprint differs"
    return ""


def check_dataset(prefix: str | os.PathLike, scan_limit_bytes: int | None = None,
                  trust_metadata: bool = False) -> DatasetFacts:
    """Check ``prefix`` (index header, version, dtype, pointers, ``.bin`` size, metadata counts).

    The largest token id comes from the metadata; without it the ``.bin`` is scanned in chunks when it is
    at most ``scan_limit_bytes`` (None: always). ``trust_metadata``: the metadata check where the metadata's
    index facts match (see the module). Raises ``IndexedFormatError`` / ``MetadataError`` (both ``ValueError``)
    naming the file.
    """
    if not bin_path(prefix).is_file() and idx_path(prefix).is_file():
        raise IndexedFormatError(f"{bin_path(prefix)}: data file not found (index {idx_path(prefix)} exists)")
    why_full, checked = "", "full"
    if trust_metadata:
        info = read_index(prefix)  # header, version, dtype and the .idx size; the arrays stay unread
        meta = read_meta(prefix)
        why_full = _metadata_mismatch(prefix, info, meta)
        if not why_full:
            assert meta is not None
            check_bin_size(prefix, int(meta["tokens"]), info.dtype)
            checked = "metadata"
    if checked == "full":
        info = check_consistency(prefix)
        meta = read_meta(prefix)
        if meta is not None:
            check_meta_matches(prefix, meta, info)
    top, source = None, "unchecked"
    if meta is not None and meta.get("max_token_id") is not None:
        top, source = int(meta["max_token_id"]), "metadata"
    elif scan_limit_bytes is None or bin_path(prefix).stat().st_size <= scan_limit_bytes:
        top, source = max_token_id(prefix), "scan"  # None for an empty .bin
    return DatasetFacts(os.fspath(prefix), info, meta, top, source, checked, why_full)
