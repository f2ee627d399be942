"""``merge``: concatenate indexed datasets, as ``IndexedDatasetBuilder.add_index`` would (same bytes)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from data_tools.indexed import IndexedFormatError, bin_path, check_consistency, write_index_streaming


def merge(inputs: list[str], output_prefix: str) -> str:
    """Merge dataset ``inputs`` (prefixes) into ``output_prefix``; return a one-line report.

    Every input is verified first; their dtypes must match. Output appears only when complete.
    """
    if not inputs:
        raise ValueError("merge needs at least one input prefix")
    infos = [check_consistency(p) for p in inputs]
    dtypes = {i.dtype for i in infos}
    if len(dtypes) != 1:
        kinds = ", ".join(f"{p} ({i.dtype.name})" for p, i in zip(inputs, infos))
        raise IndexedFormatError(f"cannot merge datasets with different token dtypes: {kinds}")
    out = Path(output_prefix)
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise ValueError(f"output directory is missing or not writable: {out.parent}")
    tmp_bin, tmp_idx = Path(f"{out}.bin.tmp"), Path(f"{out}.idx.tmp")
    tmp_len, tmp_docs = Path(f"{out}.lengths.tmp"), Path(f"{out}.docs.tmp")
    try:
        n_seq = 0
        with open(tmp_bin, "wb") as fb, open(tmp_len, "wb") as fl, open(tmp_docs, "wb") as fd:
            for prefix, info in zip(inputs, infos):
                with open(bin_path(prefix), "rb") as src:
                    shutil.copyfileobj(src, fb, 1 << 22)
                fl.write(np.ascontiguousarray(info.sequence_lengths).tobytes())
                fd.write((np.asarray(info.document_indices[1:], dtype=np.int64) + n_seq).tobytes())
                n_seq += info.num_sequences
        write_index_streaming(tmp_idx, infos[0].dtype, tmp_len, tmp_docs)
        Path(f"{out}.idx").unlink(missing_ok=True)
        os.replace(tmp_bin, f"{out}.bin")
        os.replace(tmp_idx, f"{out}.idx")
    finally:
        for p in (tmp_bin, tmp_idx, tmp_len, tmp_docs):
            p.unlink(missing_ok=True)
    docs = sum(i.num_documents for i in infos)
    toks = sum(i.num_tokens for i in infos)
    return f"merged {len(inputs)} datasets into {out}.bin/.idx: {docs:,} documents, {toks:,} tokens"
