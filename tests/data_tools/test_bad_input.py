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


# ------------------------------------------------------------------ input bytes: every format, every tokenizer

BAD_UTF8 = b'{"text": "bad \xff"}\n{"text": "ok"}\n'


def _bad_utf8_inputs(d: Path) -> list[Path]:
    """The same two documents (invalid UTF-8, then "ok") as JSONL, .jsonl.gz, .jsonl.zst and Parquet."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d.mkdir()
    (d / "a.jsonl").write_bytes(BAD_UTF8)
    (d / "b.jsonl.gz").write_bytes(gzip.compress(BAD_UTF8))
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(BAD_UTF8))
    offsets = pa.py_buffer(np.array([0, 5, 7], dtype=np.int32).tobytes())  # pyarrow does not check this UTF-8
    column = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"bad \xffok")])
    pq.write_table(pa.table({"text": column}), d / "d.parquet")
    return sorted(d.iterdir())


def _prep(tmp_path: Path, inputs: list[Path], *extra: str, args: dict | None = None) -> list[str]:
    args = args or SP_ARGS
    argv = ["preprocess", "--input", *map(str, inputs), "--output-prefix", str(tmp_path / "o"), "--no-progress",
            "--tokenizer-type", args["tokenizer_type"]]
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        if args.get(key):
            argv += [f"--{key.replace('_', '-')}", args[key]]
    return argv + list(extra)


def test_invalid_utf8_is_skipped_in_every_format_by_the_fast_encoder(tmp_path: Path) -> None:
    """The issue's command: gigatoken (the default encoder) used to segfault (exit 139) on the first file."""
    import subprocess
    import sys

    files = _bad_utf8_inputs(tmp_path / "in")
    r = subprocess.run([sys.executable, "-m", "data_tools", *_prep(tmp_path, files)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "encoder gigatoken" in r.stdout
    assert f"skipped:   4 invalid UTF-8 (first: {files[0]}:1)" in r.stdout
    assert f"skipped {files[3]}:1: invalid UTF-8 (column 'text': byte 0xff at byte 5)" in r.stderr
    tok = load_tokenizer(**SP_ARGS)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.tokenize("ok")] * 4


@pytest.mark.parametrize("encoder,args", [("reference", SP_ARGS), ("auto", GPT2_ARGS)],
                         ids=["sentencepiece-reference", "bpe-gigatoken"])
def test_invalid_utf8_other_encoders_and_strict(tmp_path: Path, capsys, encoder: str, args: dict) -> None:
    files = _bad_utf8_inputs(tmp_path / "in")
    assert main(_prep(tmp_path, files, "--encoder", encoder, args=args)) == 0
    out = capsys.readouterr().out
    assert f"skipped:   4 invalid UTF-8 (first: {files[0]}:1)" in out
    # --strict: the run stops at the first one, naming file:line, and leaves nothing behind.
    assert main(_prep(tmp_path / "in", files[1:2], "--strict", "--encoder", encoder, args=args)) == 1
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert errors == [f"error: {files[1]}:1: invalid UTF-8 (byte 0xff at column 15)"]
    assert not [p for p in (tmp_path / "in").iterdir() if p.name.startswith("o_")]


def _cut(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _corrupt_parquet(path: Path, texts: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), path, row_group_size=len(texts) // 4)
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(2).column(0).data_page_offset
    data[start + 20 : start + 400] = b"\0" * 380
    path.write_bytes(bytes(data))
    return path


def test_truncated_or_corrupt_input_is_refused_naming_file_and_offset(tmp_path: Path, capsys) -> None:
    """A partial download never becomes a shorter dataset: every compressed or columnar format, and plain JSONL
    cut inside a line, is refused naming the file and where (offset, row group, line)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = corpus_texts(40, 600)
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    d = tmp_path / "in"
    d.mkdir()
    zst = zstandard.ZstdCompressor().compress(raw)
    (d / "cut.jsonl.zst").write_bytes(_cut(zst))
    (d / "garbage.jsonl.zst").write_bytes(zst + b"garbage")
    (d / "cut.jsonl.gz").write_bytes(_cut(gzip.compress(raw)))
    (d / "cut.jsonl").write_bytes(raw[: len(raw) // 2 + 7])
    pq.write_table(pa.table({"text": texts}), d / "whole.parquet")
    (d / "cut.parquet").write_bytes(_cut((d / "whole.parquet").read_bytes()))
    _corrupt_parquet(d / "corrupt.parquet", texts)
    expected = {
        "cut.jsonl.zst": "ends inside a zstd frame at compressed byte",
        "garbage.jsonl.zst": "corrupt zstd data near compressed byte",
        "cut.jsonl.gz": "truncated or corrupt gzip data near compressed byte",
        "cut.jsonl": "the file ends inside this line (no final newline, not valid JSON): truncated?",
        "cut.parquet": "not a readable Parquet file, truncated or corrupt",
        "corrupt.parquet": "row group 2 (of 4; rows 21-30 of the file) cannot be read from row 21: the file is corrupt",
    }
    for name, message in expected.items():
        assert main(_prep(tmp_path, [d / name], "--encoder", "reference")) == 1, name
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
        assert len(err) == 1 and err[0].startswith(f"error: {d / name}") and message in err[0], (name, err)
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("o_")], name


def test_file_that_is_not_what_its_name_says(tmp_path: Path, capsys) -> None:
    """Magic bytes, not thousands of "invalid UTF-8" lines: say what the file really is."""
    import bz2

    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = GOOD * 3
    cases = {"gz.jsonl": (gzip.compress(raw), "is gzip-compressed data, not JSON lines: rename it with the suffix "
                                              ".jsonl.gz"),
             "plain.jsonl.gz": (raw, "is plain text, not gzip-compressed data as its name says: rename it with the "
                                     "suffix .jsonl"),
             "bz2.jsonl": (bz2.compress(raw), "is bzip2-compressed data, which preprocess does not read: decompress "
                                                "it first (bunzip2) or recompress it as .jsonl.zst"),
             "pq.jsonl": (None, "is a Parquet file, not JSON lines: rename it with the suffix .parquet")}
    for name, (data, message) in cases.items():
        if data is None:
            pq.write_table(pa.table({"text": ["a"]}), tmp_path / name)
        else:
            (tmp_path / name).write_bytes(data)
        assert main(_prep(tmp_path, [tmp_path / name])) == 1
        assert capsys.readouterr().err.strip() == f"error: {tmp_path / name}: {message}", name
    # pzstd (and zstd --content-size tools) start with a skippable frame: still zstd, read as such.
    import struct

    import zstandard

    skip = b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"meta"
    (tmp_path / "p.jsonl.zst").write_bytes(skip + zstandard.ZstdCompressor().compress(raw))
    assert main(_prep(tmp_path, [tmp_path / "p.jsonl.zst"], "--encoder", "reference")) == 0
    assert "documents: 3" in capsys.readouterr().out


def test_numbers_and_prefixes_checked_and_paths_written_printed(tmp_path: Path, small_corpus: Path, capsys) -> None:
    for argv, message in ((["--workers", "0"], "--workers 0: must be a whole number of tokenizer threads, at least 1"),
                          (["--workers", "-3"], "--workers -3: must be"), (["--batch-mb", "0"], "--batch-mb: must")):
        assert main(_prep(tmp_path, [small_corpus], *argv)) == 1
        assert message in capsys.readouterr().err
    assert main(_prep(tmp_path, [small_corpus], "--encoder", "reference")) == 0
    p = tmp_path / "o_text_document"
    assert f"wrote:     {p}.bin {p}.idx {p}.meta.json (train with data.blend=[{p}])" in capsys.readouterr().out
    # merge says which files it wrote, and what the preprocess prefix was called.
    assert main(["merge", "--inputs", str(tmp_path / "o"), "--output-prefix", str(tmp_path / "m")]) == 1
    assert (f"{tmp_path / 'o'}.idx: index file not found (did you mean {p}? preprocess adds _KEY_document to its "
            "--output-prefix)") in capsys.readouterr().err
    assert main(["merge", "--inputs", str(p), "--output-prefix", str(tmp_path / "m.bin")]) == 1
    assert "a prefix has no extension" in capsys.readouterr().err
    assert main(["merge", "--inputs", str(p), "--output-prefix", str(tmp_path / "m")]) == 0
    m = tmp_path / "m"
    assert f"wrote: {m}.bin {m}.idx {m}.meta.json (train with data.blend=[{m}])" in capsys.readouterr().out
