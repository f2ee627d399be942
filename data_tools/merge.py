"""``merge``: concatenate indexed datasets, as ``IndexedDatasetBuilder.add_index`` would (same bytes), and
carry their ``PREFIX.meta.json`` (inputs made with different tokenizers are refused)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pretrain.dataset_format.indexed import (
    IndexedFormatError,
    bin_path,
    check_consistency,
    idx_path,
    write_index_streaming,
)
from pretrain.dataset_format.metadata import (
    check_meta_matches,
    commit_meta,
    dataset_record,
    meta_path,
    read_meta,
    record_tokenizer,
    write_meta_tmp,
)
from pretrain.files import commit


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def _merged_meta(inputs: list[str], infos: list, metas: list, log: Callable[[str], None]) -> dict | None:
    """The output's metadata; None (with a warning) when an input has none. Raises on mixed tokenizers."""
    missing = [p for p, m in zip(inputs, metas) if m is None]
    tokenizers = [record_tokenizer(m) for m in metas if m is not None]
    if len({t.sha256 for t in tokenizers}) > 1:
        kinds = "; ".join(f"{p}: {record_tokenizer(m).describe()}" for p, m in zip(inputs, metas) if m is not None)
        raise IndexedFormatError(f"cannot merge datasets made with different tokenizers ({kinds})")
    if missing:
        log(f"warning: {', '.join(missing)} has no {meta_path('PREFIX').name} (made by another tool?), so the "
            "merged dataset's tokenizer is unknown: no metadata is written for it")
        return None
    eods = {m.get("append_eod") for m in metas}
    tops = [m.get("max_token_id") for m in metas]
    return dataset_record(
        tool="data_tools merge", tokenizer=tokenizers[0], append_eod=eods.pop() if len(eods) == 1 else None,
        dtype=infos[0].dtype.name, documents=sum(i.num_documents for i in infos),
        sequences=sum(i.num_sequences for i in infos), tokens=sum(i.num_tokens for i in infos),
        max_token_id=None if None in tops else max(tops, default=None),
        inputs=[{"prefix": os.path.abspath(p), "documents": i.num_documents, "tokens": i.num_tokens,
                 "created_by": m.get("created_by")} for p, i, m in zip(inputs, infos, metas)],
    )  # fmt: skip


def merge(inputs: list[str], output_prefix: str, log: Callable[[str], None] | None = None) -> str:
    """Merge dataset ``inputs`` (prefixes) into ``output_prefix``; return a one-line report.

    Every input is verified first; their dtypes and tokenizers must match, and the output may not be one of
    them. Output appears only when complete (``.bin``, then ``.idx``, then ``.meta.json``).
    """
    log = log or (lambda m: print(m, file=sys.stderr))
    if not inputs:
        raise ValueError("merge needs at least one input prefix")
    out = Path(output_prefix)
    for ext in (".bin", ".idx", ".meta.json"):
        if output_prefix.endswith(ext):
            raise ValueError(f"--output-prefix {output_prefix}: a prefix has no extension (merge writes PREFIX.bin, "
                             f"PREFIX.idx, PREFIX.meta.json); use {output_prefix[: -len(ext)]}")
    for p in inputs:
        for path_of in (bin_path, idx_path):
            if _same_file(path_of(p), path_of(out)):
                raise ValueError(f"the output prefix {output_prefix} is also an input ({p}): merging would overwrite "
                                 "it; choose another --output-prefix")
    infos = [check_consistency(p) for p in inputs]
    dtypes = {i.dtype for i in infos}
    if len(dtypes) != 1:
        kinds = ", ".join(f"{p} ({i.dtype.name})" for p, i in zip(inputs, infos))
        raise IndexedFormatError(f"cannot merge datasets with different token dtypes: {kinds}")
    metas = [read_meta(p) for p in inputs]
    for p, i, m in zip(inputs, infos, metas):
        if m is not None:
            check_meta_matches(p, m, i)
    record = _merged_meta(inputs, infos, metas, log)
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise ValueError(f"output directory is missing or not writable: {out.parent}")
    tmp_bin, tmp_idx = Path(f"{out}.bin.tmp"), Path(f"{out}.idx.tmp")
    tmp_len, tmp_docs = Path(f"{out}.lengths.tmp"), Path(f"{out}.docs.tmp")
    tmp_meta = Path(f"{meta_path(out)}.tmp")
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
        if record is not None:
            write_meta_tmp(out, record)
        meta_path(out).unlink(missing_ok=True)  # never leave an old description next to new data
        Path(f"{out}.idx").unlink(missing_ok=True)
        commit(tmp_bin, f"{out}.bin")
        commit(tmp_idx, f"{out}.idx")
        if record is not None:
            commit_meta(out)
    finally:
        for p in (tmp_bin, tmp_idx, tmp_len, tmp_docs, tmp_meta):
            p.unlink(missing_ok=True)
    docs = sum(i.num_documents for i in infos)
    toks = sum(i.num_tokens for i in infos)
    written = " ".join(f"{out}{ext}" for ext in (".bin", ".idx", ".meta.json") if ext != ".meta.json" or record)
    return (f"merged {len(inputs)} datasets into {out}.bin/.idx{'/.meta.json' if record else ''}: "
            f"{docs:,} documents, {toks:,} tokens\nwrote: {written} (train with data.blend=[{out}])")
