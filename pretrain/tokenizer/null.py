"""The null tokenizer: token ids without a vocabulary file, for synthetic (mock) data.

`data.mock=true` without a blend and without tokenizer files, for a tokenizer type that embeds none
(`huggingface`, `tiktoken`: e.g. the shipped Llama-3 and Qwen3 configs), trains with a null tokenizer of the
model's vocabulary size (`model.vocab_size`, the preset's): ids 0..V-1, EOD = V-1 (the last id), which is also
what Megatron-LM's `--tokenizer-type NullTokenizer --vocab-size V-1` gives. The SentencePiece and GPT-2 BPE
types keep their embedded tokenizers (`pretrain.tokenizer.embedded`). A real blend needs the tokenizer its
data was made with.

Megatron-Core's own `NullTokenizer` does the ids (`megatron_text.NullTextTokenizer`, imported lazily).
"""

from __future__ import annotations

import hashlib
from typing import Any

from pretrain.tokenizer.identity import TokenizerIdentity
from pretrain.tokenizer.types import HUGGINGFACE, TIKTOKEN, tokenizer_kind

NULL_KIND = "null"
_NO_EMBEDDED = (HUGGINGFACE, TIKTOKEN)  # tokenizer kinds without an embedded fallback


def falls_back_to_null(tokenizer_type: str, model: str | None, vocab: str | None, merges: str | None,
                       mock: bool) -> bool:
    """True when a run uses the null tokenizer: mock data (no blend), no tokenizer file, a type with no
    embedded tokenizer."""
    return mock and model is None and vocab is None and merges is None \
        and tokenizer_kind(tokenizer_type) in _NO_EMBEDDED


def null_identity(vocab_size: int) -> TokenizerIdentity:
    """The identity of the null tokenizer of `vocab_size` ids (no files; EOD the last id)."""
    digest = hashlib.sha256(f"kind={NULL_KIND}\nvocab_size={vocab_size}\neod={vocab_size - 1}\n".encode())
    return TokenizerIdentity(NULL_KIND, (), digest.hexdigest(), int(vocab_size), int(vocab_size) - 1)


def needs_vocab_size(tokenizer_type: str, preset: str | None) -> str:
    """Why a mock run's null tokenizer has no size: model.vocab_size is null (and what `preset` says about it)."""
    return (f"data.mock=true with data.tokenizer_type={tokenizer_type} and no tokenizer file uses a null tokenizer, "
            f"which needs model.vocab_size{_preset_vocab(preset)}")


def _preset_vocab(preset: str | None) -> str:
    """What model.preset says about model.vocab_size, for the message about it being null."""
    if not preset:
        return ""
    from model_providers import get_preset

    try:
        size = get_preset(preset).get("vocab_size")
    except KeyError:
        size = None
    if size is None:
        return f" (model.preset={preset} sets none)"
    return f" (model.vocab_size=null overrides the {size:,} that model.preset={preset} sets)"


def describe_null(vocab_size: int) -> str:
    return f"a null tokenizer of {vocab_size:,} ids (EOD = {vocab_size - 1:,}, the last id; no files)"


def null_tokenizer(vocab_size: int) -> Any:
    """A `megatron.core.tokenizers` text tokenizer over Megatron-Core's `NullTokenizer`: `vocab_size` ids,
    EOD = `vocab_size - 1` (`pretrain.tokenizer.megatron_text.NullTextTokenizer`)."""
    from pretrain.tokenizer.megatron_text import NullTextTokenizer

    if vocab_size < 2:
        raise ValueError(f"a null tokenizer needs at least 2 ids, got {vocab_size}")
    return NullTextTokenizer(int(vocab_size))
