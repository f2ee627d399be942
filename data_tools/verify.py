"""``verify PREFIX``: a ``.bin``/``.idx`` pair is consistent (header, counts, offsets, sizes, ids), and so is
its ``PREFIX.meta.json`` when there is one (``pretrain.dataset_format.check``, also the trainer's pre-flight
check), and every id is below a tokenizer's vocabulary."""

from __future__ import annotations

import os
from typing import Any

from pretrain.dataset_format.check import DatasetFacts, check_dataset
from pretrain.dataset_format.indexed import IndexedFormatError, find_token_outside
from pretrain.dataset_format.metadata import MetadataError, record_tokenizer

__all__ = ["DatasetFacts", "check_dataset", "verify"]


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
