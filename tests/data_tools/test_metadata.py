"""PREFIX.meta.json: written by `preprocess`, carried by `merge` (which refuses mixed tokenizers and an output
that is one of its inputs), checked by `verify` — and `verify` prints only its own lines."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_tools.__main__ import main
from pretrain.dataset_format.indexed import read_index, read_tokens
from pretrain.tokenizer.embedded import GPT2_MERGES, GPT2_VOCAB, MISTRAL_TOKENIZER
from pretrain.tokenizer.identity import describe_tokenizer
from tests.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
SP = ["--tokenizer-type", "sentencepiece", "--tokenizer-model", str(MISTRAL_TOKENIZER)]


def _meta(prefix: str | Path) -> dict:
    return json.loads(Path(f"{prefix}.meta.json").read_text())


def _digest(prefix: str | Path) -> str:
    return hashlib.sha256(Path(f"{prefix}.bin").read_bytes() + Path(f"{prefix}.idx").read_bytes()).hexdigest()


def test_preprocess_writes_metadata(tmp_path, small_corpus):
    proc = run_cli("data_tools", ["preprocess", "--input", str(small_corpus), "--output-prefix", str(tmp_path / "c"),
                                  *SP, "--append-eod"], cwd=REPO)
    assert proc.rc == 0, proc.stderr
    prefix = tmp_path / "c_text_document"
    assert f"output:    {prefix}.bin/.idx (+ .meta.json" in proc.stdout
    meta, info = _meta(prefix), read_index(prefix)
    assert (meta["format"], meta["version"], meta["created_by"]["tool"]) == ("megapretrain-dataset-meta", 1,
                                                                             "data_tools preprocess")
    assert (meta["documents"], meta["sequences"], meta["tokens"]) == (info.num_documents, info.num_sequences,
                                                                      info.num_tokens)
    assert meta["max_token_id"] == int(np.max(read_tokens(prefix)))
    assert (meta["append_eod"], meta["dtype"], meta["json_key"], meta["keep_empty"]) == (True, "uint16", "text", False)
    assert meta["inputs"] == [{"path": str(small_corpus.resolve()), "bytes": small_corpus.stat().st_size}]
    tok = meta["tokenizer"]
    assert (tok["kind"], tok["vocab_size"], tok["eod"], tok["files"]) == ("sentencepiece", 32000, 2,
                                                                          [str(MISTRAL_TOKENIZER)])
    # The hash is of the contents: the same model at another path matches, another tokenizer does not.
    moved = tmp_path / "elsewhere.model"
    shutil.copy(MISTRAL_TOKENIZER, moved)
    assert describe_tokenizer("sentencepiece", str(moved)).sha256 == tok["sha256"]
    gpt2 = describe_tokenizer("GPT2BPETokenizer", None, str(GPT2_VOCAB), str(GPT2_MERGES))
    assert gpt2.sha256 != tok["sha256"] and gpt2.vocab_size == 50257


def test_merge_carries_metadata(small_datasets, tmp_path, capsys):
    a, b = small_datasets["a"], small_datasets["b"]
    assert main(["merge", "--inputs", a, b, "--output-prefix", str(tmp_path / "ab")]) == 0
    assert "into " + str(tmp_path / "ab") + ".bin/.idx/.meta.json" in capsys.readouterr().out
    merged, ma, mb = _meta(tmp_path / "ab"), _meta(a), _meta(b)
    assert merged["created_by"]["tool"] == "data_tools merge"
    assert merged["tokenizer"] == ma["tokenizer"] == mb["tokenizer"]
    assert merged["documents"] == ma["documents"] + mb["documents"] == read_index(tmp_path / "ab").num_documents
    assert merged["tokens"] == ma["tokens"] + mb["tokens"]
    assert merged["max_token_id"] == max(ma["max_token_id"], mb["max_token_id"])
    assert [i["prefix"] for i in merged["inputs"]] == [a, b] and merged["append_eod"] is True
    assert main(["verify", str(tmp_path / "ab")]) == 0
    assert "metadata ab.meta.json consistent" in capsys.readouterr().out


def test_merge_refuses_mixed_tokenizers_and_overwriting_an_input(small_datasets, tmp_path, capsys):
    a, gpt2 = small_datasets["a"], small_datasets["gpt2"]
    assert main(["merge", "--inputs", a, gpt2, "--output-prefix", str(tmp_path / "mixed")]) == 1
    err = capsys.readouterr().err
    assert "error: cannot merge datasets made with different tokenizers (" in err
    assert "sentencepiece tokenizer.model" in err and "bpe-pair vocab.json + merges.txt" in err
    assert list(tmp_path.iterdir()) == []  # nothing written
    # The output may not be an input: the input stays byte for byte.
    copy = tmp_path / "a_text_document"
    for ext in (".bin", ".idx", ".meta.json"):
        shutil.copy(a + ext, f"{copy}{ext}")
    before = _digest(copy)
    assert main(["merge", "--inputs", str(copy), small_datasets["b"], "--output-prefix", str(copy)]) == 1
    assert f"error: the output prefix {copy} is also an input ({copy})" in capsys.readouterr().err
    assert _digest(copy) == before and read_index(copy).num_documents == 40


def test_merge_without_input_metadata_warns(small_datasets, tmp_path, capsys):
    nometa = tmp_path / "nometa"
    for ext in (".bin", ".idx"):
        shutil.copy(small_datasets["a"] + ext, f"{nometa}{ext}")
    assert main(["merge", "--inputs", str(nometa), small_datasets["b"], "--output-prefix", str(tmp_path / "m")]) == 0
    err = capsys.readouterr().err
    assert f"warning: {nometa} has no PREFIX.meta.json (made by another tool?)" in err
    assert not (tmp_path / "m.meta.json").exists() and (tmp_path / "m.idx").exists()


@pytest.mark.parametrize("corrupt", [False, True], ids=["ok", "truncated"])
def test_verify_with_tokenizer_prints_only_its_own_lines(small_datasets, tmp_path, corrupt):
    prefix = tmp_path / "v"
    for ext in (".bin", ".idx", ".meta.json"):
        shutil.copy(small_datasets["a"] + ext, f"{prefix}{ext}")
    if corrupt:
        Path(f"{prefix}.bin").write_bytes(Path(f"{prefix}.bin").read_bytes()[:1000])
    proc = subprocess.run([sys.executable, "-m", "data_tools", "verify", str(prefix), *SP], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    if corrupt:
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr.strip().splitlines() == [f"error: {prefix}.bin: 1000 bytes but the index describes "
                                                    f"{_meta(prefix)['tokens']} tokens of uint16 = "
                                                    f"{2 * _meta(prefix)['tokens']} bytes (truncated)"]
    else:
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.strip().endswith("metadata v.meta.json consistent, all ids < 32000")
    # A tokenizer other than the one that made the data is named (in this process: the message, not the output).
    if not corrupt:
        wrong = run_cli("data_tools", ["verify", str(prefix), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                       str(GPT2_VOCAB), "--merge-file", str(GPT2_MERGES)], cwd=REPO)
        assert wrong.rc == 1
        assert wrong.stderr.strip().startswith(f"error: {prefix} was made with sentencepiece tokenizer.model")
