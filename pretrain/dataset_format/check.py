"""A dataset checked as a whole: index header, version, dtype, pointers, ``.bin`` size and the counts of its
``PREFIX.meta.json``, with its largest token id. The trainer's pre-flight check and ``data_tools verify``
both use :func:`check_dataset`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pretrain.dataset_format.indexed import IndexInfo, bin_path, check_consistency, max_token_id
from pretrain.dataset_format.metadata import check_meta_matches, read_meta


@dataclass
class DatasetFacts:
    """A checked dataset: its index, its metadata (None without ``PREFIX.meta.json``) and its largest id."""

    prefix: str
    info: IndexInfo
    meta: dict[str, Any] | None
    max_token_id: int | None  # None: empty, or not known (no metadata and the scan was skipped)
    max_id_from: str  # "metadata" | "scan" | "unchecked"


def check_dataset(prefix: str | os.PathLike, scan_limit_bytes: int | None = None) -> DatasetFacts:
    """Check ``prefix`` (index header, version, dtype, pointers, ``.bin`` size, metadata counts).

    The largest token id comes from the metadata; without it the ``.bin`` is scanned in chunks when it is
    at most ``scan_limit_bytes`` (None: always). Raises ``IndexedFormatError`` / ``MetadataError`` (both
    ``ValueError``) naming the file.
    """
    info = check_consistency(prefix)
    meta = read_meta(prefix)
    if meta is not None:
        check_meta_matches(prefix, meta, info)
    top, source = None, "unchecked"
    if meta is not None and meta.get("max_token_id") is not None:
        top, source = int(meta["max_token_id"]), "metadata"
    elif scan_limit_bytes is None or bin_path(prefix).stat().st_size <= scan_limit_bytes:
        top, source = (max_token_id(prefix) if info.num_tokens else None), "scan"
    return DatasetFacts(os.fspath(prefix), info, meta, top, source)
