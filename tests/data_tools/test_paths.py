"""Paths beyond the common case: tiktoken, several --json-keys, surrogate escapes, cache resets.

Each checks the written dataset against the tokenizer ``load_tokenizer`` returns (the trainer's).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from data_tools.__main__ import main
from data_tools.inputs import InputError
from data_tools.preprocess import PreprocessError, preprocess
from pretrain.tokenizer import load_tokenizer

from .conftest import GPT2_ARGS, SP_ARGS, corpus_texts, write_jsonl


def _docs(prefix: Path) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))]


def _tiny_tiktoken(path: Path, texts: list[str]) -> Path:
    """A Megatron tiktoken JSON vocabulary: the 256 bytes plus merges learnt greedily from ``texts``."""
    ranks: list[bytes] = [bytes([b]) for b in range(256)]
    data = "".join(texts).encode()
    seen = set(ranks)
    for n in (2, 3, 4):  # the most frequent n-grams whose halves are already tokens
        counts: dict[bytes, int] = {}
        for i in range(0, min(len(data), 200_000) - n):
            g = data[i : i + n]
            counts[g] = counts.get(g, 0) + 1
        for g, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:80]:
            if g not in seen and g[:-1] in seen and g[-1:] in seen:
                ranks.append(g)
                seen.add(g)
    vocab = [
        {"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
        for i, t in enumerate(ranks)
    ]
    path.write_text(json.dumps(vocab))
    return path


def test_tiktoken_matches_megatron_core(tmp_path: Path, capsys) -> None:
    texts = corpus_texts(12, 1500) + ["special-looking </s> and <s> in text", "unicode: Ünïcödé 中文 🤖"]
    vocab = _tiny_tiktoken(tmp_path / "tiny_tiktoken.json", texts)
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    args = {"tokenizer_type": "tiktoken", "tokenizer_model": str(vocab)}
    s = preprocess([str(corpus)], str(tmp_path / "o"), append_eod=True, batch_bytes=4 << 10, **args)
    tok = load_tokenizer(**args)
    assert s.encoder == "tiktoken" and s.dtype == "uint16" and s.documents == len(texts)
    assert _docs(tmp_path / "o_text_document") == [tok.tokenize(t) + [tok.eod] for t in texts]
    assert max(max(d) for d in _docs(tmp_path / "o_text_document")) < tok.vocab_size
    # Megatron-LM's type name through the CLI gives the same bytes.
    rc = main(
        ["preprocess", "--input", str(corpus), "--output-prefix", str(tmp_path / "cli"), "--append-eod"]
        + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(vocab), "--no-progress"]
    )
    assert rc == 0, capsys.readouterr().err
    for ext in ("bin", "idx"):
        assert (tmp_path / f"cli_text_document.{ext}").read_bytes() == (
            tmp_path / f"o_text_document.{ext}"
        ).read_bytes()


def _cli_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 1
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1
    return errors[0]


def test_tiktoken_bad_vocabulary(tmp_path: Path, small_corpus: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match=f"{bad}: expected a JSON list"):
        preprocess([str(small_corpus)], str(tmp_path / "o"), tokenizer_type="tiktoken", tokenizer_model=str(bad))
    line = _cli_error(
        capsys,
        ["preprocess", "--input", str(small_corpus), "--output-prefix", str(tmp_path / "o")]
        + ["--tokenizer-type", "tiktoken", "--tokenizer-model", str(bad), "--no-progress"],
    )
    assert line.startswith(f"error: {bad}: expected a JSON list")
    assert not list(tmp_path.glob("o*"))


def test_several_json_keys(tmp_path: Path, capsys) -> None:
    texts = corpus_texts(10, 1200)
    rows = [{"title": f"Title {i}: {t[:40]}", "text": t, "other": i} for i, t in enumerate(texts)]
    rows[4] = {"text": texts[4]}  # no title: the whole line is skipped, for both outputs
    rows[7]["title"] = ""  # empty title: dropped from the title dataset only
    lines = [json.dumps(r) for r in rows]
    corpus = tmp_path / "multi.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    s = preprocess(
        [str(corpus)], str(tmp_path / "m"), json_keys=["text", "title"], append_eod=True, batch_bytes=2 << 10, **SP_ARGS
    )
    tok = load_tokenizer(**SP_ARGS)
    kept = [r for i, r in enumerate(rows) if i != 4]
    assert _docs(tmp_path / "m_text_document") == [tok.tokenize(r["text"]) + [tok.eod] for r in kept]
    assert _docs(tmp_path / "m_title_document") == [tok.tokenize(r["title"]) + [tok.eod] for r in kept if r["title"]]
    assert s.documents == 9 and s.skipped == {"missing key 'title'": 1, "empty document": 1}
    err = capsys.readouterr().err
    assert "multi.jsonl:5: missing key 'title'" in err and "multi.jsonl:8: empty document ('title')" in err
    # Each key's dataset equals a single-key run over the same lines.
    single = write_jsonl(tmp_path / "single.jsonl", [r["text"] for r in kept])
    preprocess([str(single)], str(tmp_path / "s"), append_eod=True, **SP_ARGS)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"s_text_document.{ext}").read_bytes() == (tmp_path / f"m_text_document.{ext}").read_bytes()


def test_json_keys_errors(tmp_path: Path, small_corpus: Path, capsys) -> None:
    with pytest.raises(PreprocessError, match="--json-keys lists a key twice: text text"):
        preprocess([str(small_corpus)], str(tmp_path / "o"), json_keys=["text", "text"], **SP_ARGS)
    with pytest.raises(InputError, match=r"corpus.jsonl:1: missing key 'body'"):
        preprocess([str(small_corpus)], str(tmp_path / "o"), json_keys=["text", "body"], strict=True, **SP_ARGS)
    base = ["preprocess", "--input", str(small_corpus), "--output-prefix", str(tmp_path / "o"), "--no-progress"]
    base += ["--tokenizer-type", "sentencepiece", "--tokenizer-model", SP_ARGS["tokenizer_model"]]
    assert _cli_error(capsys, [*base, "--json-keys", "text", "text"]) == (
        "error: --json-keys lists a key twice: text text"
    )
    line = _cli_error(capsys, [*base, "--json-keys", "text", "body", "--strict"])
    assert line.endswith("corpus.jsonl:1: missing key 'body'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]


def test_surrogate_escapes(tmp_path: Path, capsys) -> None:
    good = corpus_texts(3, 500)
    raw = [json.dumps({"text": t}) for t in good]
    raw.insert(1, '{"text": "emoji pair \\ud83d\\ude00 ok"}')  # a valid pair: kept, decoded
    raw.insert(3, '{"text": "lone \\ud800 surrogate"}')  # invalid: skipped with its line
    raw.insert(4, '{"text": "reversed \\uDC00\\uD800"}')
    corpus = tmp_path / "s.jsonl"
    corpus.write_text("\n".join(raw) + "\n")
    s = preprocess([str(corpus)], str(tmp_path / "o"), **SP_ARGS)
    tok = load_tokenizer(**SP_ARGS)
    kept = [good[0], "emoji pair \U0001f600 ok", good[1], good[2]]
    assert _docs(tmp_path / "o_text_document") == [tok.tokenize(t) for t in kept]
    assert s.skipped == {"key 'text' holds an unpaired surrogate escape": 2}
    err = capsys.readouterr().err
    assert "s.jsonl:4: key 'text' holds an unpaired surrogate escape" in err and "s.jsonl:5:" in err


@pytest.mark.parametrize("args", [SP_ARGS, GPT2_ARGS], ids=["sentencepiece", "gpt2-bpe"])
def test_encoder_cache_resets_keep_ids(tmp_path: Path, args: dict) -> None:
    pytest.importorskip("gigatoken")
    corpus = write_jsonl(tmp_path / "c.jsonl", corpus_texts(12, 2000))
    a = preprocess([str(corpus)], str(tmp_path / "a"), append_eod=True, batch_bytes=6 << 10, **args)
    b = preprocess(
        [str(corpus)], str(tmp_path / "b"), append_eod=True, batch_bytes=6 << 10, memory_budget_bytes=-(1 << 40), **args
    )
    assert a.encoder == b.encoder == "gigatoken" and a.encoder_resets == 0 and b.encoder_resets >= 3, (a, b)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"a_text_document.{ext}").read_bytes() == (tmp_path / f"b_text_document.{ext}").read_bytes()
    tok = load_tokenizer(**args)
    assert _docs(tmp_path / "a_text_document") == [tok.tokenize(t) + [tok.eod] for t in corpus_texts(12, 2000)]


def test_arrow_text_column() -> None:
    import pyarrow as pa

    from data_tools.inputs import TextColumn
    from data_tools.tokenizers import CheckedEncoder

    texts = ["plain", "has </s> inside", "", "ünï <s>", "tail"]
    arr = pa.array(["skip"] + texts, type=pa.large_string()).slice(1)  # a non-zero Arrow offset
    col = TextColumn(arr)
    assert len(col) == 5 and col[1] == texts[1] and col.to_list() == texts
    assert col.awkward().to_list() == texts
    assert col.rows_containing(("</s>", "<s>")) == [1, 3] and col.rows_containing(("a.c",)) == []
    pytest.importorskip("gigatoken")
    # The checked encoder gives the reference ids for Arrow and list input, re-routing the risky rows.
    from data_tools.tokenizers import build_batch_encoder, resolve_spec

    spec = resolve_spec(**SP_ARGS)
    enc = build_batch_encoder(spec, 1, "auto")
    ref = build_batch_encoder(spec, 1, "reference")
    assert isinstance(enc, CheckedEncoder)
    enc.risky = ("</s>", "<s>")
    for t, o in (enc.encode(col), enc.encode(texts)):
        rt, ro = ref.encode(texts)
        assert o.tolist() == ro.tolist() and t.tolist() == rt.tolist()
    assert enc.rerouted == 4 and enc.mismatches == 0


def test_tokenizer_directory_is_read_only_inside(tmp_path: Path, small_corpus: Path, capsys) -> None:
    """A tokenizer directory whose tokenizer.json / tokenizer_config.json leaves it (a symlink) is refused with one
    line (pretrain/safe_paths.py); an HF cache snapshot's links into its own blobs/ are fine."""
    from pretrain.tokenizer.spec import resolve_spec

    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        d = tmp_path / f"tok_{name}"
        d.mkdir()
        (d / "tokenizer.json").write_text("{}")
        (d / name).unlink(missing_ok=True)
        (d / name).symlink_to(outside)
        line = _cli_error(capsys, ["preprocess", "--input", str(small_corpus), "--output-prefix", str(tmp_path / "o"),
                                   "--tokenizer-type", "huggingface", "--tokenizer-model", str(d)])
        assert line.startswith(f"error: {d}/{name}: resolves to {outside}, outside {d} (in the tokenizer directory)")
    blobs, snap = tmp_path / "models--a--b" / "blobs", tmp_path / "models--a--b" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (blobs / "abc").write_text('{"eos_token": "</s>"}')
    (blobs / "def").write_text("{}")
    (snap / "tokenizer_config.json").symlink_to("../../blobs/abc")
    (snap / "tokenizer.json").symlink_to("../../blobs/def")
    assert resolve_spec("huggingface", str(snap)).eos_token == "</s>"
