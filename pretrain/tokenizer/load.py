"""The run's tokenizer as a ``megatron.core.tokenizers`` object (what ``GPTDataset`` and the trainer use)."""

from __future__ import annotations

from typing import Any

from pretrain.tokenizer.spec import resolve_spec


def load_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
) -> Any:
    """Build a ``megatron.core.tokenizers`` tokenizer (``MegatronTokenizerBase`` subclass).

    It has ``.vocab_size``, ``.eod``, ``.tokenize(text)``, ``.detokenize(ids)`` and
    ``.unique_identifiers``; ``tokenize`` gives exactly the ids ``preprocess`` writes (before EOD).
    SentencePiece and tiktoken go through Megatron-Core's own library classes, HF tokenizers through a thin
    adapter over the ``tokenizers`` library. Raises :class:`TokenizerError` (a ``ValueError``) naming the
    path for missing or bad files.
    """
    spec = resolve_spec(tokenizer_type, tokenizer_model, vocab_file, merge_file)
    from pretrain.tokenizer.megatron_text import SpecTokenizer

    return SpecTokenizer(spec)


def run_tokenizer(data_cfg: Any) -> Any:
    """The tokenizer a `data` config section names (the embedded Mistral / GPT-2 files when no path is given)."""
    from pretrain.tokenizer.embedded import with_embedded

    ttype, model, vocab, merges, _embedded = with_embedded(data_cfg.tokenizer_type, data_cfg.tokenizer_model,
                                                           data_cfg.vocab_file, data_cfg.merge_file)
    return load_tokenizer(ttype, model, vocab_file=vocab, merge_file=merges)
