"""``inspect PREFIX``: counts, dtype, document-length histogram and decoded sample documents."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pretrain.dataset_format.indexed import check_consistency, read_tokens


def length_histogram(lengths: np.ndarray, bins: int = 10) -> list[tuple[int, int, int]]:
    """(low, high, count) rows over power-of-two buckets of sequence lengths."""
    if lengths.size == 0:
        return []
    edges = 2 ** np.arange(0, max(1, int(np.ceil(np.log2(max(2, int(lengths.max()) + 1))))) + 1)
    counts, _ = np.histogram(lengths, bins=np.concatenate([[0], edges]))
    return [(int(lo), int(hi) - 1, int(c)) for lo, hi, c in zip(np.concatenate([[0], edges[:-1]]), edges, counts) if c]


def inspect_dataset(prefix: str | os.PathLike, tokenizer: Any = None, samples: int = 2, chars: int = 300) -> str:
    """A human-readable report on ``prefix``; decodes ``samples`` documents when a tokenizer is given."""
    info = check_consistency(prefix)
    lengths = np.asarray(info.sequence_lengths)
    out = [
        f"dataset:   {prefix}",
        f"documents: {info.num_documents:,}",
        f"sequences: {info.num_sequences:,}",
        f"tokens:    {info.num_tokens:,}",
        f"dtype:     {info.dtype.name}",
    ]
    if lengths.size:
        out.append(
            f"length:    min {int(lengths.min()):,}  mean {float(lengths.mean()):,.1f}  "
            f"median {int(np.median(lengths)):,}  max {int(lengths.max()):,} tokens"
        )
        out.append("histogram (tokens per sequence):")
        top = max(c for _, _, c in length_histogram(lengths))
        for lo, hi, c in length_histogram(lengths):
            out.append(f"  {lo:>8,}-{hi:<8,} {c:>10,} {'#' * max(1, round(40 * c / top))}")
    if tokenizer is not None and samples > 0 and lengths.size:
        tokens = read_tokens(prefix)
        pointers = np.asarray(info.sequence_pointers) // info.dtype.itemsize
        picks = np.unique(np.linspace(0, lengths.size - 1, num=min(samples, lengths.size)).astype(int))
        for i in picks:
            ids = np.asarray(tokens[pointers[i] : pointers[i] + lengths[i]]).tolist()
            text = tokenizer.detokenize(ids)
            shown = text[:chars] + ("…" if len(text) > chars else "")
            out.append(f"--- sequence {i} ({lengths[i]} tokens) ---\n{shown}")
    return "\n".join(out)
