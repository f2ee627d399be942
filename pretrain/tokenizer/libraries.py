"""The reference tokenizer libraries (sentencepiece, tokenizers, Megatron-Core's tiktoken) loaded from a
:class:`TokenizerSpec`, with one clear :class:`TokenizerError` per unusable file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pretrain.tokenizer.spec import TokenizerSpec
from pretrain.tokenizer.types import GPT2_EOD_TOKEN, TokenizerError


def load_sentencepiece(spec: TokenizerSpec) -> Any:
    """A ``sentencepiece.SentencePieceProcessor`` for ``spec.model``."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(spec.model)
    except (OSError, RuntimeError) as e:
        raise TokenizerError(f"{spec.model}: not a SentencePiece model ({e})") from e
    return sp


def sentencepiece_vocab_eod(sp: Any) -> tuple[int, int | None]:
    """(vocabulary size, EOD id) of a SentencePiece processor: EOD is its EOS, None when it has none."""
    return sp.get_piece_size(), (sp.eos_id() if sp.eos_id() >= 0 else None)


def load_hf(spec: TokenizerSpec) -> Any:
    """A ``tokenizers.Tokenizer`` for a ``tokenizer.json`` or a vocab/merges pair (no truncation or padding)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    if spec.kind == "bpe-pair":
        try:
            tok = Tokenizer(BPE.from_file(spec.vocab_file, spec.merge_file))
        except Exception as e:  # the Rust loader raises plain Exception
            raise TokenizerError(f"{spec.vocab_file} / {spec.merge_file}: not a BPE vocab/merges pair ({e})") from e
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        try:
            tok = Tokenizer.from_file(spec.model)
        except Exception as e:
            raise TokenizerError(f"{spec.model}: not a HuggingFace tokenizer.json ({e})") from e
    tok.no_truncation()
    tok.no_padding()
    return tok


def _tiktoken_vocab_size(path: str) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: not a Megatron tiktoken JSON vocabulary ({e})") from e
    if not isinstance(vocab, list) or not vocab:
        raise TokenizerError(f"{path}: expected a JSON list of {{rank, token_bytes, token_str}} entries")
    return min(2**17, len(vocab) + 1000)


def load_tiktoken(spec: TokenizerSpec) -> Any:
    """Megatron-Core's TikTokenTokenizer (default special tokens, pattern v2)."""
    from megatron.core.tokenizers.text.libraries import TikTokenTokenizer

    vocab_size = _tiktoken_vocab_size(spec.model)  # its own clear TokenizerError
    try:
        return TikTokenTokenizer(spec.model, vocab_size=vocab_size)
    except (AssertionError, KeyError, ValueError) as e:
        raise TokenizerError(f"{spec.model}: not a Megatron tiktoken JSON vocabulary ({e!r})") from e


def tiktoken_vocab_eod(lib: Any) -> tuple[int, int | None]:
    """(vocabulary size, EOD id) of a loaded TikTokenTokenizer."""
    return (lib.vocab_size if isinstance(lib.vocab_size, int) else lib._vocab_size), lib.eos_id


def _hf_special_affixes(tok: Any) -> tuple[list[int], list[int]]:
    """Ids the post-processor adds around a single sequence (e.g. BOS), as (prefix, suffix)."""
    for probe in ("x", "Hello world"):
        plain = tok.encode(probe, add_special_tokens=False).ids
        full = tok.encode(probe, add_special_tokens=True).ids
        for k in range(len(full) - len(plain) + 1):
            if full[k : k + len(plain)] == plain:
                prefix, suffix = full[:k], full[k + len(plain) :]
                break
        else:
            raise TokenizerError("the tokenizer's post-processor is not a simple prefix/suffix template")
    return prefix, suffix


@dataclass
class HFInfo:
    """A loaded HF tokenizer with its vocabulary size, EOD id and the ids added around every sequence."""

    tok: Any
    vocab_size: int
    eod: int | None
    prefix: list[int]
    suffix: list[int]


def hf_info(spec: TokenizerSpec) -> HFInfo:
    """Load an HF tokenizer (``tokenizer.json`` or vocab/merges pair) and read its EOD and specials."""
    tok = load_hf(spec)
    if spec.kind == "bpe-pair":
        eod = tok.token_to_id(GPT2_EOD_TOKEN)
        return HFInfo(tok, tok.get_vocab_size(with_added_tokens=False), eod, [], [])
    eod = tok.token_to_id(spec.eos_token) if spec.eos_token else None
    prefix, suffix = _hf_special_affixes(tok) if spec.add_special_tokens else ([], [])
    return HFInfo(tok, tok.get_vocab_size(with_added_tokens=True), eod, prefix, suffix)


def reference_vocab_eod(spec: TokenizerSpec) -> tuple[int, int | None]:
    """(vocabulary size, EOD id) read with the reference library (no Megatron import except for tiktoken)."""
    if spec.kind == "sentencepiece":
        return sentencepiece_vocab_eod(load_sentencepiece(spec))
    if spec.kind == "tiktoken":
        return tiktoken_vocab_eod(load_tiktoken(spec))
    info = hf_info(spec)
    return info.vocab_size, info.eod
