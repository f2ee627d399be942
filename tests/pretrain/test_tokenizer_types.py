"""One alias table: every tokenizer type name is accepted the same way by data_tools and the trainer."""

from __future__ import annotations

import pytest

from pretrain.tokenizer import TOKENIZER_TYPES, TokenizerError, resolve_spec
from pretrain.tokenizer.embedded import MISTRAL_TOKENIZER, with_embedded
from pretrain.tokenizer.identity import describe_tokenizer


@pytest.mark.parametrize("name", ["sentencepiece", "GPTSentencePieceTokenizer", "SentencePieceTokenizer"])
def test_sentencepiece_names_load_the_embedded_model(name):
    ttype, model, vocab, merges, embedded = with_embedded(name, None, None, None)
    assert model == str(MISTRAL_TOKENIZER) and embedded
    assert resolve_spec(ttype, model).kind == "sentencepiece"
    assert describe_tokenizer(ttype, model).vocab_size == 32000


def test_every_listed_type_is_known_and_unknown_is_one_clear_error():
    for name in TOKENIZER_TYPES:
        try:
            resolve_spec(name, MISTRAL_TOKENIZER)
        except TokenizerError as e:
            assert "unknown tokenizer type" not in str(e)
    with pytest.raises(TokenizerError, match="unknown tokenizer type 'nope'; choose one of sentencepiece"):
        resolve_spec("nope")
