"""The verdict cache of the trainer's data check: what a full read of a dataset's ``.idx`` (and the scan of its
``.bin`` for the largest id) found, kept beside Megatron's index caches (``data.cache_dir``, default
``run.dir/data_cache``) in ``dataset_checks/``, one small JSON file per prefix.

A dataset without ``PREFIX.meta.json`` index facts (every corpus Megatron-LM's ``preprocess_data.py`` made) can
only be checked by reading its whole ``.idx`` (the pointers against the lengths, the document indices): ≈ 20
bytes per document, seconds per prefix at corpus scale. That verdict is a fact about the two files, so it is
stored keyed by both files' (path, size, mtime_ns, inode), taken before the read. A later start trusts it only
when all of those are unchanged *and* what the header and file sizes show at once still agrees: the ``.idx``
header (magic, version, dtype, counts, exact size), the ``.bin`` size against the recorded token count, the last
sequence's pointer and length against the ``.bin`` size. A missing, unreadable, malformed or stale entry is
re-checked in full, never trusted; the entry is then rewritten.

Entries are written only once the run's whole validation passed (``store``), by rank 0: a refused start writes
nothing. ``python -m pretrain validate`` reads them and writes them only into a cache directory that exists.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pretrain.dataset_format.indexed import (
    _FIXED_HEADER,
    IndexHeader,
    bin_path,
    check_bin_size,
    idx_path,
    parse_header,
)

VERDICT_DIR = "dataset_checks"
VERDICT_FORMAT = "megapretrain-dataset-check"
VERDICT_VERSION = 1


def stamps(prefix: str) -> dict[str, list[int]] | None:
    """(size, mtime_ns, inode) of the ``.idx`` and ``.bin``; None when either cannot be stat'ed."""
    try:
        out = {}
        for name, path in (("idx", idx_path(prefix)), ("bin", bin_path(prefix))):
            st = os.stat(path)
            out[name] = [int(st.st_size), int(st.st_mtime_ns), int(st.st_ino)]
        return out
    except OSError:
        return None


def entry_path(cache_dir: str | os.PathLike, prefix: str) -> Path:
    """``CACHE/dataset_checks/<sha256 of the absolute prefix>.json``."""
    key = hashlib.sha256(os.path.abspath(prefix).encode()).hexdigest()[:40]
    return Path(cache_dir) / VERDICT_DIR / f"{key}.json"


def entry(facts: Any) -> dict[str, Any] | None:
    """The cache entry of a full check's ``DatasetFacts`` (None when it is not one, or has no stamps)."""
    if facts.checked != "full" or not facts.stamps:
        return None
    info = facts.info
    return {"format": VERDICT_FORMAT, "version": VERDICT_VERSION, "prefix": os.path.abspath(facts.prefix),
            **facts.stamps, "dtype": info.dtype.name, "sequences": info.num_sequences,
            "documents": info.num_documents, "tokens": info.num_tokens, "max_token_id": facts.max_token_id,
            "max_id_from": facts.max_id_from}


def lookup(cache_dir: str | os.PathLike, prefix: str, scan_limit_bytes: int | None) -> dict[str, Any] | None:
    """The verdict of ``prefix`` when its entry is present, well-formed and current, and the header and sizes
    still agree with it (``{"header": IndexHeader, "tokens", "max_token_id", "max_id_from"}``); else None.

    An entry whose largest id was not scanned (a ``.bin`` above the scan limit then) is not used when the
    ``.bin`` is now within ``scan_limit_bytes``."""
    try:
        record = json.loads(entry_path(cache_dir, prefix).read_text(encoding="utf-8"))
        now = stamps(prefix)
        if (not isinstance(record, dict) or record.get("format") != VERDICT_FORMAT
                or record.get("version") != VERDICT_VERSION or record.get("prefix") != os.path.abspath(prefix)
                or now is None or record.get("idx") != now["idx"] or record.get("bin") != now["bin"]):
            return None
        header = _header(prefix, now["idx"][0])
        tokens = int(record["tokens"])
        if (header.dtype.name, header.num_sequences, header.num_documents) != \
                (record["dtype"], int(record["sequences"]), int(record["documents"])):
            return None
        check_bin_size(prefix, tokens, header.dtype)
        if header.num_sequences:
            _, last, length = header.span(0, header.num_sequences - 1)
            if last + length * header.dtype.itemsize != tokens * header.dtype.itemsize:
                return None
        elif tokens:
            return None
        top, source = record["max_token_id"], str(record["max_id_from"])
        if source not in ("scan", "unchecked") or (source == "unchecked" and (
                scan_limit_bytes is None or now["bin"][0] <= scan_limit_bytes)):
            return None
        return {"header": header, "tokens": tokens, "max_token_id": None if top is None else int(top),
                "max_id_from": source}
    except (OSError, ValueError, KeyError, TypeError):  # unreadable, malformed or no longer matching: re-check
        return None


def _header(prefix: str, size: int) -> IndexHeader:
    with open(idx_path(prefix), "rb") as f:
        head = f.read(_FIXED_HEADER)
    return parse_header(idx_path(prefix), head, size)


def store(cache_dir: str | os.PathLike, entries: list[dict[str, Any]], create: bool = True) -> int:
    """Write ``entries`` (atomically, one file each) into ``cache_dir``; ``create=False``: only when the cache
    directory exists. Returns how many were written; a cache that cannot be written is skipped (the next start
    reads those datasets in full again)."""
    from pretrain.files import write_atomic

    if not entries or (not create and not Path(cache_dir).is_dir()):
        return 0
    written = 0
    try:
        (Path(cache_dir) / VERDICT_DIR).mkdir(parents=True, exist_ok=True)
        for e in entries:
            write_atomic(entry_path(cache_dir, e["prefix"]), json.dumps(e) + "\n", durable=False)  # a cache
            written += 1
    except OSError:
        pass
    return written
