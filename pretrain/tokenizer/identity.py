"""Which tokenizer made a dataset: a SHA-256 over its kind and the contents of its files (plus, for a
``tokenizer.json``, the EOS token and special-token handling that change the ids), so two different
tokenizers with equal vocabulary sizes differ, and the same files at another path match."""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pretrain.tokenizer.libraries import reference_vocab_eod
from pretrain.tokenizer.spec import resolve_spec


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


def spec_sha256(spec: Any) -> tuple[tuple[str, ...], str]:
    """(absolute files, identity SHA-256) of a resolved ``TokenizerSpec``: its files are hashed, the tokenizer is
    not loaded (what a sharded run compares its parts' tokenizer with, ``data_tools.shards``)."""
    h = hashlib.sha256(f"kind={spec.kind}\n".encode())
    files = []
    for role in ("model", "vocab_file", "merge_file"):
        path = getattr(spec, role)
        if path:
            files.append(os.path.abspath(path))
            h.update(f"{role}={_file_sha256(path)}\n".encode())
    if spec.kind == "hf-json":
        h.update(f"eos={spec.eos_token}\nadd_special_tokens={spec.add_special_tokens}\n".encode())
    return tuple(files), h.hexdigest()


def tokenizer_identity(spec: Any, vocab_size: int, eod: int | None) -> TokenizerIdentity:
    """The identity of a resolved ``TokenizerSpec`` whose vocabulary size and EOD id are known."""
    files, sha = spec_sha256(spec)
    return TokenizerIdentity(spec.kind, files, sha, int(vocab_size), eod)


def describe_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None, vocab_file: str | None = None,
                       merge_file: str | None = None) -> TokenizerIdentity:
    """Load a tokenizer with its reference library (no Megatron import for SentencePiece or HF files) and
    return its identity; raises ``TokenizerError`` naming the file."""
    spec = resolve_spec(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    vocab_size, eod = reference_vocab_eod(spec)
    return tokenizer_identity(spec, vocab_size, eod)
