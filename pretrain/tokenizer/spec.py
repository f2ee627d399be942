"""User arguments (type and files) resolved to a :class:`TokenizerSpec`: which library, which files.

============================  ===============================================  =========================
type                          model files                                      EOD / special tokens
============================  ===============================================  =========================
sentencepiece,                ``--tokenizer-model tokenizer.model``            EOD = model's EOS id,
GPTSentencePieceTokenizer,                                                     no BOS added
SentencePieceTokenizer
huggingface,                  ``--tokenizer-model`` dir with ``tokenizer.json``  EOD = ``eos_token`` of
HuggingFaceTokenizer          (+ ``tokenizer_config.json``) or the file        ``tokenizer_config.json``;
                                                                               post-processor specials
                                                                               (e.g. BOS) are added
huggingface (pair),           ``--vocab-file vocab.json --merge-file           EOD = ``<|endoftext|>``,
GPT2BPETokenizer              merges.txt``                                     no specials in text
tiktoken, TikTokenizer        Megatron tiktoken ``.json`` vocabulary           Megatron-Core
                                                                               ``TikTokenTokenizer``
============================  ===============================================  =========================
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain import safe_paths
from pretrain.tokenizer.types import BYTE_BPE, SENTENCEPIECE, TIKTOKEN, TokenizerError, checked_kind


@dataclass(frozen=True)
class TokenizerSpec:
    """A resolved tokenizer: which family, which files, and how ids are produced."""

    kind: str  # "sentencepiece" | "hf-json" | "bpe-pair" | "tiktoken"
    model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    eos_token: str | None = None  # hf-json: the EOS named in tokenizer_config.json
    add_special_tokens: bool = False  # hf-json: Megatron-LM's HuggingFaceTokenizer adds them

    @property
    def library(self) -> str:
        return {"sentencepiece": "sentencepiece", "tiktoken": "tiktoken"}.get(self.kind, "huggingface")


def _need_file(path: str | os.PathLike | None, what: str) -> str:
    if path is None:
        raise TokenizerError(f"{what} is required but was not given")
    p = Path(path)
    if not p.exists():
        raise TokenizerError(f"{what} not found: {p}")
    if not p.is_file():
        raise TokenizerError(f"{what} is not a file: {p}")
    if not os.access(p, os.R_OK):
        raise TokenizerError(f"{what} is not readable: {p}")
    return os.fspath(p)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _in_dir(model_dir: Path, name: str) -> Path:
    """A file the tokenizer directory names, read only inside it (`pretrain.safe_paths`)."""
    try:
        return safe_paths.inside(model_dir, name, "in the tokenizer directory")
    except (safe_paths.UnsafePathError, FileNotFoundError) as e:
        raise TokenizerError(str(e)) from None


def _eos_from_config(model_dir: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = model_dir / name
        if safe_paths.present(model_dir, name) and not cfg.is_dir():
            try:
                eos = _token_content(json.loads(_in_dir(model_dir, name).read_text(encoding="utf-8")).get("eos_token"))
            except (OSError, ValueError, AttributeError) as e:
                if isinstance(e, TokenizerError):
                    raise
                raise TokenizerError(f"{cfg}: not valid JSON ({e})") from e
            if eos:
                return eos
    return None


def resolve_spec(
    tokenizer_type: str,
    tokenizer_model: str | os.PathLike | None = None,
    vocab_file: str | os.PathLike | None = None,
    merge_file: str | os.PathLike | None = None,
) -> TokenizerSpec:
    """Validate user arguments (types and files) and return a :class:`TokenizerSpec`."""
    kind = checked_kind(tokenizer_type)
    if kind == SENTENCEPIECE:
        return TokenizerSpec("sentencepiece", model=_need_file(tokenizer_model, "SentencePiece --tokenizer-model"))
    if kind == TIKTOKEN:
        return TokenizerSpec("tiktoken", model=_need_file(tokenizer_model, "tiktoken --tokenizer-model (.json)"))
    if kind == BYTE_BPE or (tokenizer_model is None and vocab_file is not None):
        return TokenizerSpec(
            "bpe-pair",
            vocab_file=_need_file(vocab_file, "--vocab-file (vocab.json)"),
            merge_file=_need_file(merge_file, "--merge-file (merges.txt)"),
        )
    if tokenizer_model is None:
        raise TokenizerError("huggingface tokenizer needs --tokenizer-model (tokenizer.json or its directory)")
    model = Path(tokenizer_model)
    if model.is_dir():
        if not safe_paths.present(model, "tokenizer.json"):
            raise TokenizerError(f"{tokenizer_model}: directory holds no tokenizer.json")
        _in_dir(model, "tokenizer.json")
        model = model / "tokenizer.json"
    model_path = _need_file(model, "HuggingFace --tokenizer-model")
    return TokenizerSpec("hf-json", model=model_path, eos_token=_eos_from_config(model.parent), add_special_tokens=True)
