"""Paths of the data embedded in the package: the quickstart's default corpus (here) and the embedded
tokenizers (owned by ``pretrain.tokenizer.embedded``, re-exported)."""

from pathlib import Path

from pretrain.tokenizer.embedded import GPT2_MERGES, GPT2_VOCAB, MISTRAL_TOKENIZER

__all__ = ["ASSETS_DIR", "DEFAULT_CORPUS", "GPT2_MERGES", "GPT2_VOCAB", "MISTRAL_TOKENIZER"]

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_CORPUS = ASSETS_DIR / "corpus" / "python-3.11-docs-subset.jsonl"
