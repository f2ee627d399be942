"""`data_tools preprocess --tokenizer-type sentencepiece` without `--tokenizer-model` uses the embedded tokenizer the
trainer falls back to without `data.tokenizer_model` (one owner: `pretrain.tokenizer.embedded`), named in one note;
the trainer's pre-flight check then accepts the dataset as made with its own tokenizer."""

from __future__ import annotations

from data_tools.__main__ import main
from pretrain.dataset_format.metadata import read_meta, record_tokenizer
from pretrain.tokenizer.embedded import MISTRAL_TOKENIZER
from pretrain.tokenizer.identity import describe_tokenizer
from tests.data_tools.conftest import corpus_texts, write_jsonl


def test_preprocess_without_a_model_uses_the_trainers_embedded_tokenizer(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", corpus_texts(4, 500))
    assert main(["preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "d"),
                 "--tokenizer-type", "sentencepiece", "--append-eod", "--no-progress"]) == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: ")]
    assert notes == [f"note: no tokenizer files given: using the embedded Mistral-7B SentencePiece (32,000 tokens) "
                     f"tokenizer ({MISTRAL_TOKENIZER}), as the trainer does without data.tokenizer_model"], notes
    prefix = f"{tmp_path}/d_text_document"
    trainers = describe_tokenizer("sentencepiece", str(MISTRAL_TOKENIZER))
    assert record_tokenizer(read_meta(prefix)).sha256 == trainers.sha256

    from pretrain.__main__ import main as pretrain_main

    assert pretrain_main(["validate", "tiny_llama", f"data.blend=[{prefix}]", "data.split=1,0,0"]) == 0, \
        capsys.readouterr()
