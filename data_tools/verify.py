"""``verify PREFIX``: a ``.bin``/``.idx`` pair is consistent (header, counts, offsets, sizes, ids), and so is
its ``PREFIX.meta.json`` when there is one. :func:`check_dataset` is also the trainer's pre-flight check."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from data_tools.indexed import (
    IndexedFormatError,
    IndexInfo,
    bin_path,
    check_consistency,
    find_token_outside,
    max_token_id,
)
from data_tools.metadata import MetadataError, check_meta_matches, read_meta, record_tokenizer


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


def verify(prefix: str | os.PathLike, tokenizer: Any = None) -> str:
    """Check ``prefix``; with a tokenizer (anything with ``vocab_size``) also check every id is below it.

    Returns a one-line report; raises :class:`IndexedFormatError` (a ``ValueError``) naming the file.
    """
    facts = check_dataset(prefix, scan_limit_bytes=0)
    info = facts.info
    report = (
        f"OK {prefix}: {info.num_documents:,} documents, {info.num_sequences:,} sequences, "
        f"{info.num_tokens:,} tokens ({info.dtype.name})"
    )
    if facts.meta is not None:
        report += f", metadata {os.path.basename(os.fspath(prefix))}.meta.json consistent"
    made_with = record_tokenizer(facts.meta) if facts.meta is not None else None
    theirs = getattr(tokenizer, "sha256", None)
    if made_with is not None and theirs is not None and theirs != made_with.sha256:
        raise MetadataError(f"{prefix} was made with {made_with.describe()}, not with {tokenizer.describe()}")
    if tokenizer is not None and info.num_tokens:
        vocab = int(tokenizer.vocab_size)
        bad = find_token_outside(prefix, vocab)
        if bad is not None:
            raise IndexedFormatError(f"{prefix}.bin: token {bad[0]} has id {bad[1]}, outside the vocabulary of {vocab}")
        report += f", all ids < {vocab}"
    return report
