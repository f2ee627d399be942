"""``PREFIX.meta.json``: what made a dataset — tokenizer, options, counts, largest token id.

Megatron's indexed format (``.bin``/``.idx``) does not say which tokenizer produced the ids, so a run can
train on ids from another vocabulary without noticing. ``preprocess`` and ``merge`` write this small JSON
file beside the pair (Megatron-LM and Megatron-Core never read or write a ``.meta.json`` next to a
dataset prefix; their own side files are ``.bin``, ``.idx`` and cache files named by hash). The trainer
compares the recorded tokenizer with its own and reads the largest token id instead of scanning the
``.bin``. Datasets without the file (made by other tools) still work; they are checked less.

The tokenizer is identified by a SHA-256 over its kind and the contents of its files (plus, for a
``tokenizer.json``, the EOS token and special-token handling that change the ids), so two different
tokenizers with equal vocabulary sizes differ, and the same files at another path match.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pretrain.dataset_format.fingerprint import INDEX_KEY, index_facts
from pretrain.dataset_format.indexed import IndexInfo, bin_path, idx_path
from pretrain.files import commit, tmp_path, write_synced
from pretrain.tokenizer.identity import TokenizerIdentity

META_SUFFIX = ".meta.json"
META_FORMAT = "megapretrain-dataset-meta"
META_VERSION = 1


class MetadataError(ValueError):
    """A ``PREFIX.meta.json`` that cannot be read or does not describe its dataset."""


def tool_version() -> str:
    """The installed megapretrain version (``unknown`` when running from an uninstalled checkout)."""
    try:
        from importlib.metadata import version

        return version("megapretrain")
    except Exception:  # noqa: BLE001 - any lookup failure
        return "unknown"


def meta_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.meta.json``."""
    return Path(f"{os.fspath(prefix)}{META_SUFFIX}")


def dataset_record(*, tool: str, tokenizer: TokenizerIdentity, append_eod: bool | None, dtype: str,
                   documents: int, sequences: int, tokens: int, max_token_id: int | None,
                   inputs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The JSON object written to ``PREFIX.meta.json``."""
    return {
        "format": META_FORMAT, "version": META_VERSION,
        "created_by": {"tool": tool, "version": tool_version()},
        "tokenizer": tokenizer.to_dict(),
        "append_eod": append_eod, "dtype": dtype,
        "documents": int(documents), "sequences": int(sequences), "tokens": int(tokens),
        "max_token_id": None if max_token_id is None else int(max_token_id),
        "inputs": inputs, **extra,
    }  # fmt: skip


def write_meta_tmp(prefix: str | os.PathLike, record: dict[str, Any]) -> Path:
    """Write ``PREFIX.meta.json.tmp`` (synced); :func:`commit_meta` renames it into place.

    The record gets the pair's index facts (``"index"``: sizes and fingerprint, see ``fingerprint``) unless it
    has them: from the prepared temporaries ``PREFIX.idx.tmp``/``PREFIX.bin.tmp`` that are about to be committed
    with it (``preprocess``, ``merge``), else from ``PREFIX.idx``/``PREFIX.bin``.
    """
    if INDEX_KEY not in record:
        pair = (tmp_path(idx_path(prefix)), tmp_path(bin_path(prefix)))
        if not all(p.is_file() for p in pair):
            pair = (idx_path(prefix), bin_path(prefix))
        if all(p.is_file() for p in pair):
            record = {**record, INDEX_KEY: index_facts(*pair)}
    return write_synced(tmp_path(meta_path(prefix)), json.dumps(record, indent=1) + "\n")


def commit_meta(prefix: str | os.PathLike) -> None:
    """Rename ``PREFIX.meta.json.tmp`` into place."""
    commit(tmp_path(meta_path(prefix)), meta_path(prefix))


def read_meta(prefix: str | os.PathLike) -> dict[str, Any] | None:
    """The metadata of ``prefix``, or None when there is no ``PREFIX.meta.json``."""
    path = meta_path(prefix)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("format") != META_FORMAT:
            raise ValueError(f"format is {record.get('format')!r}, expected {META_FORMAT!r}")
        if int(record.get("version", 0)) > META_VERSION:
            raise ValueError(f"version {record['version']} is newer than this tool's {META_VERSION}")
        TokenizerIdentity.from_dict(record["tokenizer"])
        for key in ("documents", "sequences", "tokens"):
            int(record[key])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise MetadataError(f"{path}: not a readable dataset metadata file ({e})") from None
    return record


def record_tokenizer(record: dict[str, Any]) -> TokenizerIdentity:
    """The tokenizer identity stored in a record returned by :func:`read_meta`."""
    return TokenizerIdentity.from_dict(record["tokenizer"])


def check_meta_matches(prefix: str | os.PathLike, record: dict[str, Any], info: IndexInfo) -> None:
    """Raise :class:`MetadataError` when the record's counts are not those of the index beside it."""
    have = (info.num_documents, info.num_sequences, info.num_tokens)
    said = (int(record["documents"]), int(record["sequences"]), int(record["tokens"]))
    if have != said:
        raise MetadataError(
            f"{meta_path(prefix)} describes {said[0]:,} documents / {said[2]:,} tokens but {prefix}.idx holds "
            f"{have[0]:,} documents / {have[2]:,} tokens: the metadata belongs to another dataset"
        )
