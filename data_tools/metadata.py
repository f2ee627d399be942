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

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_tools.indexed import IndexInfo
from pretrain.files import commit, tmp_path, write_synced

META_SUFFIX = ".meta.json"
META_FORMAT = "megapretrain-dataset-meta"
META_VERSION = 1


class MetadataError(ValueError):
    """A ``PREFIX.meta.json`` that cannot be read or does not describe its dataset."""


@dataclass(frozen=True)
class TokenizerIdentity:
    """Which tokenizer: its kind, the files it was loaded from, their content hash, vocabulary and EOD."""

    kind: str  # TokenizerSpec.kind: sentencepiece | hf-json | bpe-pair | tiktoken
    files: tuple[str, ...]
    sha256: str
    vocab_size: int
    eod: int | None

    def describe(self) -> str:
        names = " + ".join(Path(f).name for f in self.files) or "no files"
        return f"{self.kind} {names} (sha256 {self.sha256[:12]}, vocabulary {self.vocab_size:,}, EOD {self.eod})"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["files"] = list(self.files)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenizerIdentity:
        return cls(str(d["kind"]), tuple(str(f) for f in d.get("files", [])), str(d["sha256"]),
                   int(d["vocab_size"]), None if d.get("eod") is None else int(d["eod"]))


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_identity(spec: Any, vocab_size: int, eod: int | None) -> TokenizerIdentity:
    """The identity of a resolved ``TokenizerSpec`` whose vocabulary size and EOD id are known."""
    h = hashlib.sha256(f"kind={spec.kind}\n".encode())
    files = []
    for role in ("model", "vocab_file", "merge_file"):
        path = getattr(spec, role)
        if path:
            files.append(os.path.abspath(path))
            h.update(f"{role}={_file_sha256(path)}\n".encode())
    if spec.kind == "hf-json":
        h.update(f"eos={spec.eos_token}\nadd_special_tokens={spec.add_special_tokens}\n".encode())
    return TokenizerIdentity(spec.kind, tuple(files), h.hexdigest(), int(vocab_size), eod)


def describe_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_file: str | None = None,
                       merge_file: str | None = None) -> TokenizerIdentity:
    """Load a tokenizer with its reference library (no Megatron import for SentencePiece or HF files) and
    return its identity; raises ``TokenizerError`` naming the file."""
    from data_tools.tokenizers import build_batch_encoder, resolve_spec

    spec = resolve_spec(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    enc = build_batch_encoder(spec, 1, "reference")
    return tokenizer_identity(spec, enc.vocab_size, enc.eod)


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
    """Write ``PREFIX.meta.json.tmp`` (synced); :func:`commit_meta` renames it into place."""
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
