"""``verify PREFIX``: a ``.bin``/``.idx`` pair is consistent (header, counts, offsets, sizes, ids)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from data_tools.indexed import IndexedFormatError, check_consistency, read_tokens

_CHUNK = 1 << 24


def verify(prefix: str | os.PathLike, tokenizer: Any = None) -> str:
    """Check ``prefix``; with a tokenizer also check every id is below its vocab size.

    Returns a one-line report; raises :class:`IndexedFormatError` (a ``ValueError``) naming the file.
    """
    info = check_consistency(prefix)
    report = (
        f"OK {prefix}: {info.num_documents:,} documents, {info.num_sequences:,} sequences, "
        f"{info.num_tokens:,} tokens ({info.dtype.name})"
    )
    if tokenizer is not None and info.num_tokens:
        vocab = int(tokenizer.vocab_size)
        tokens = read_tokens(prefix)
        for start in range(0, tokens.size, _CHUNK):
            chunk = np.asarray(tokens[start : start + _CHUNK])
            bad = np.flatnonzero((chunk.astype(np.int64) >= vocab) | (chunk.astype(np.int64) < 0))
            if bad.size:
                pos = start + int(bad[0])
                raise IndexedFormatError(
                    f"{prefix}.bin: token {pos} has id {int(tokens[pos])}, outside the vocabulary of {vocab}"
                )
        report += f", all ids < {vocab}"
    return report
