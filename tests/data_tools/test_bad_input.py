"""Every bad input gives one clear error naming the cause (file + line), or is skipped and counted."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from data_tools.__main__ import main
from data_tools.inputs import InputError
from data_tools.preprocess import PreprocessError, preprocess
from data_tools.verify import verify
from pretrain.dataset_format.indexed import IndexedFormatError
from pretrain.tokenizer import TokenizerError, load_tokenizer

from .conftest import GPT2_ARGS, SP_ARGS, corpus_texts, write_jsonl

GOOD = json.dumps({"text": "hello world"}).encode() + b"\n"
BAD_LINES = {
    "malformed JSON": b'{"text": "unterminated\n',
    "missing key 'text'": b'{"body": "x"}\n',
    "invalid UTF-8": b'{"text": "caf\xe9"}\n',
    "blank line": b"\n",
    "empty document": b'{"text": ""}\n',
}


def _corpus(tmp_path: Path) -> Path:
    p = tmp_path / "bad.jsonl"
    p.write_bytes(GOOD + b"".join(BAD_LINES.values()) + GOOD)
    return p


def test_default_skips_and_counts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    s = preprocess([str(_corpus(tmp_path))], str(tmp_path / "o"), append_eod=True, **SP_ARGS)
    assert s.documents == 2
    assert sorted(s.skipped) == sorted(BAD_LINES)
    err = capsys.readouterr().err
    assert "bad.jsonl:3: missing key 'text'" in err and "bad.jsonl:4: invalid UTF-8" in err
    assert "bad.jsonl:6: empty document" in err


@pytest.mark.parametrize("line_no,reason", [(2, "malformed JSON"), (3, "missing key")])
def test_strict_stops_at_first_bad_line(tmp_path: Path, line_no: int, reason: str) -> None:
    p = tmp_path / "c.jsonl"
    p.write_bytes(GOOD + (BAD_LINES["malformed JSON"] if line_no == 2 else GOOD + BAD_LINES["missing key 'text'"]))
    with pytest.raises(InputError, match=rf"c.jsonl:{line_no}: {reason}"):
        preprocess([str(p)], str(tmp_path / "o"), strict=True, **SP_ARGS)
    assert not list(tmp_path.glob("o*"))


def test_empty_input_fails_without_output(tmp_path: Path) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_bytes(b"")
    with pytest.raises(InputError, match="no documents"):
        preprocess([str(p)], str(tmp_path / "o"), **SP_ARGS)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["empty.jsonl"]


def test_missing_or_wrong_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="not found: /nope/tokenizer.model"):
        load_tokenizer("sentencepiece", "/nope/tokenizer.model")
    junk = tmp_path / "junk.model"
    junk.write_text("not a model")
    with pytest.raises(TokenizerError, match=str(junk)):
        load_tokenizer("GPTSentencePieceTokenizer", str(junk))
    with pytest.raises(TokenizerError, match="merge-file"):
        load_tokenizer("GPT2BPETokenizer", vocab_file=GPT2_ARGS["vocab_file"])
    with pytest.raises(TokenizerError, match="unknown tokenizer type"):
        load_tokenizer("BertWordPiece", "x")


def test_output_directory_missing(tmp_path: Path, small_corpus: Path) -> None:
    with pytest.raises(PreprocessError, match="output directory does not exist"):
        preprocess([str(small_corpus)], str(tmp_path / "no" / "such" / "o"), **SP_ARGS)


def test_missing_input_and_cli_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(
        [
            "preprocess",
            "--input",
            str(tmp_path / "missing.jsonl"),
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer-type",
            "sentencepiece",
            "--tokenizer-model",
            SP_ARGS["tokenizer_model"],
        ]
    )
    assert rc == 1 and "missing.jsonl: input not found" in capsys.readouterr().err


def test_compressed_parquet_and_directory_inputs(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = corpus_texts(6, 800)
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "a.jsonl", texts[:2])
    (d / "b.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts[2:4]).encode()))
    pq.write_table(pa.table({"text": texts[4:5]}), d / "c.parquet")
    (d / "d.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress((json.dumps({"text": texts[5]}) + "\n").encode())
    )
    s = preprocess([str(d)], str(tmp_path / "o"), **SP_ARGS)
    tok = load_tokenizer(**SP_ARGS)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert s.documents == 6 and [ds[i].tolist() for i in range(6)] == [tok.tokenize(t) for t in texts]


def test_verify_truncated_and_corrupt(tmp_path: Path, small_corpus: Path, capsys: pytest.CaptureFixture) -> None:
    preprocess([str(small_corpus)], str(tmp_path / "o"), **SP_ARGS)
    prefix = tmp_path / "o_text_document"
    assert verify(prefix, load_tokenizer(**SP_ARGS)).startswith("OK")
    with pytest.raises(IndexedFormatError, match="ids? .*outside the vocabulary"):
        verify(prefix, type("T", (), {"vocab_size": 10})())
    data = prefix.with_suffix(".bin").read_bytes()
    prefix.with_suffix(".bin").write_bytes(data[:-10])
    with pytest.raises(IndexedFormatError, match="truncated"):
        verify(prefix)
    prefix.with_suffix(".bin").write_bytes(data)
    idx = prefix.with_suffix(".idx").read_bytes()
    prefix.with_suffix(".idx").write_bytes(idx[:40])
    assert main(["verify", str(prefix)]) == 1
    assert "truncated or corrupt" in capsys.readouterr().err
    prefix.with_suffix(".idx").write_bytes(b"garbage!" + idx[8:])
    with pytest.raises(IndexedFormatError, match="bad magic"):
        verify(prefix)
