"""Fixtures shared by the whole suite."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")


@pytest.fixture(scope="session")
def embedded_dataset(tmp_path_factory) -> str:
    """The embedded corpus preprocessed with the embedded Mistral tokenizer: a `..._text_document` prefix."""
    from data_tools.assets import DEFAULT_CORPUS, MISTRAL_TOKENIZER
    from data_tools.preprocess import preprocess

    out = Path(tmp_path_factory.mktemp("embedded")) / "python_docs"
    preprocess([str(DEFAULT_CORPUS)], str(out), "sentencepiece", str(MISTRAL_TOKENIZER), append_eod=True,
               workers=1)
    return f"{out}_text_document"
