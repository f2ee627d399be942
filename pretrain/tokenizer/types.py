"""Tokenizer type names: the one alias table every command and the trainer use.

Names follow Megatron-LM's ``--tokenizer-type`` so existing commands carry over; matching ignores case.
"""

from __future__ import annotations

# type name (lower case) -> kind of tokenizer
_TYPE_ALIASES = {
    "sentencepiece": "sentencepiece",
    "gptsentencepiecetokenizer": "sentencepiece",
    "sentencepiecetokenizer": "sentencepiece",
    "huggingface": "huggingface",
    "huggingfacetokenizer": "huggingface",
    "gpt2bpetokenizer": "gpt2bpe",
    "tiktoken": "tiktoken",
    "tiktokenizer": "tiktoken",
}
TOKENIZER_TYPES = (
    "sentencepiece",
    "huggingface",
    "tiktoken",
    "GPTSentencePieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "SentencePieceTokenizer",
)
SENTENCEPIECE, HUGGINGFACE, BYTE_BPE, TIKTOKEN = "sentencepiece", "huggingface", "gpt2bpe", "tiktoken"
GPT2_EOD_TOKEN = "<|endoftext|>"


class TokenizerError(ValueError):
    """A tokenizer type or file that cannot be used; the message names the path."""


def tokenizer_kind(tokenizer_type: str | None) -> str | None:
    """``sentencepiece``, ``huggingface``, ``gpt2bpe`` or ``tiktoken`` for a type name; None when unknown."""
    return _TYPE_ALIASES.get(str(tokenizer_type).lower())


def checked_kind(tokenizer_type: str) -> str:
    """:func:`tokenizer_kind`, raising :class:`TokenizerError` that lists the types for an unknown name."""
    kind = tokenizer_kind(tokenizer_type)
    if kind is None:
        raise TokenizerError(f"unknown tokenizer type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    return kind
