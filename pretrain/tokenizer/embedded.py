"""The tokenizers embedded in the package (see assets/README.md) and when a run falls back to them."""

from __future__ import annotations

from pathlib import Path

from pretrain.tokenizer.types import BYTE_BPE, SENTENCEPIECE, tokenizer_kind

EMBEDDED_DIR = Path(__file__).resolve().parent / "assets"
MISTRAL_TOKENIZER = EMBEDDED_DIR / "mistral-7b-v0.1" / "tokenizer.model"
_BYTE_BPE_DIR = EMBEDDED_DIR / "gpt2"  # family-name-ok: the directory of the embedded GPT-2 BPE tokenizer files
GPT2_VOCAB = _BYTE_BPE_DIR / "vocab.json"
GPT2_MERGES = _BYTE_BPE_DIR / "merges.txt"


def with_embedded(tokenizer_type: str, model: str | None, vocab: str | None,
                  merges: str | None) -> tuple[str, str | None, str | None, str | None, str | None]:
    """(type, model, vocab, merges, embedded): the embedded Mistral SentencePiece model for a SentencePiece
    type without a model, the embedded GPT-2 BPE pair for ``GPT2BPETokenizer`` without files; ``embedded``
    names the embedded tokenizer used (None when the given files are used). Other types need their files."""
    kind = tokenizer_kind(tokenizer_type)
    if kind == SENTENCEPIECE and model is None:
        return tokenizer_type, str(MISTRAL_TOKENIZER), vocab, merges, "Mistral-7B SentencePiece (32,000 tokens)"
    if kind == BYTE_BPE and vocab is None and model is None:
        return tokenizer_type, model, str(GPT2_VOCAB), str(GPT2_MERGES), "GPT-2 BPE (50,257 tokens)"
    return tokenizer_type, model, vocab, merges, None
