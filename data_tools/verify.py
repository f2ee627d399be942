"""``verify PREFIX``: a ``.bin``/``.idx`` pair is consistent (header, counts, offsets, sizes, ids), and so is
its ``PREFIX.meta.json`` when there is one (``pretrain.dataset_format.check``, also the trainer's pre-flight
check), and every id is below a tokenizer's vocabulary."""

from __future__ import annotations

import os
from typing import Any

from pretrain.dataset_format.check import DatasetFacts, check_dataset
from pretrain.dataset_format.fingerprint import INDEX_KEY, index_facts, recorded_facts
from pretrain.dataset_format.indexed import IndexedFormatError, bin_path, find_token_outside, idx_path
from pretrain.dataset_format.metadata import MetadataError, commit_meta, write_meta_tmp

__all__ = ["DatasetFacts", "check_dataset", "verify"]


def verify(prefix: str | os.PathLike, tokenizer: Any = None, update_meta: bool = False) -> str:
    """Check ``prefix``; with a tokenizer (anything with ``vocab_size``) also check every id is below it.

    ``update_meta``: once every check passed, record the pair's index facts (sizes, fingerprint) in its
    ``PREFIX.meta.json`` when they are missing or stale, so the trainer's pre-flight check reads only the header.

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
    made_with = facts.tokenizer
    theirs = getattr(tokenizer, "sha256", None)
    if made_with is not None and theirs is not None and theirs != made_with.sha256:
        raise MetadataError(f"{prefix} was made with {made_with.describe()}, not with {tokenizer.describe()}")
    if tokenizer is not None and info.num_tokens:
        vocab = int(tokenizer.vocab_size)
        bad = find_token_outside(prefix, vocab)
        if bad is not None:
            raise IndexedFormatError(f"{prefix}.bin: token {bad[0]} has id {bad[1]}, outside the vocabulary of {vocab}")
        report += f", all ids < {vocab}"
    if update_meta:
        report += _update_meta(prefix, facts.meta)
    return report


def _update_meta(prefix: str | os.PathLike, meta: dict | None) -> str:
    if meta is None:
        return "; no .meta.json to record index facts in"
    if recorded_facts(meta) == index_facts(idx_path(prefix), bin_path(prefix)):
        return "; index facts already recorded"
    write_meta_tmp(prefix, {k: v for k, v in meta.items() if k != INDEX_KEY})
    commit_meta(prefix)
    return f"; index facts recorded in {os.path.basename(os.fspath(prefix))}.meta.json"
