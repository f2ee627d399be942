"""Paths of the data embedded in the package (the quickstart's default corpus and tokenizers)."""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_CORPUS = ASSETS_DIR / "corpus" / "python-3.11-docs-subset.jsonl"
MISTRAL_TOKENIZER = ASSETS_DIR / "tokenizers" / "mistral-7b-v0.1" / "tokenizer.model"
GPT2_VOCAB = ASSETS_DIR / "tokenizers" / "gpt2" / "vocab.json"
GPT2_MERGES = ASSETS_DIR / "tokenizers" / "gpt2" / "merges.txt"
