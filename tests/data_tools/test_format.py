"""Byte compatibility with Megatron-Core's indexed dataset format and Megatron-LM's preprocess."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from data_tools.merge import merge
from data_tools.preprocess import preprocess
from data_tools.tokenizers import build_batch_encoder, load_tokenizer, resolve_spec
from pretrain.dataset_format.indexed import IndexedWriter, read_index

from .conftest import GPT2_ARGS, SP_ARGS, corpus_texts


def _reference_build(prefix: Path, texts: list[str], tokenizer, append_eod: bool) -> None:
    """What Megatron-LM's preprocess_data.py does: one add_document per JSON line."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
    for text in texts:
        ids = tokenizer.tokenize(text)
        lens = [len(ids)] if ids else []
        if ids and append_eod:
            ids = ids + [tokenizer.eod]
            lens[-1] += 1
        builder.add_document(ids, lens)
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("tok_args", [SP_ARGS, GPT2_ARGS], ids=["sentencepiece", "gpt2"])
@pytest.mark.parametrize("append_eod", [True, False])
def test_byte_identical_to_builder(tmp_path: Path, small_corpus: Path, tok_args: dict, append_eod: bool) -> None:
    out = tmp_path / "out"
    summary = preprocess([str(small_corpus)], str(out), append_eod=append_eod, workers=2, **tok_args)
    tok = load_tokenizer(**tok_args)
    _reference_build(tmp_path / "ref", corpus_texts(), tok, append_eod)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"out_text_document.{ext}").read_bytes() == (tmp_path / f"ref.{ext}").read_bytes()
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert len(ds) == summary.documents == len(corpus_texts())
    first = tok.tokenize(corpus_texts()[0]) + ([tok.eod] if append_eod else [])
    assert ds[0].tolist() == first
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*state*"))


def test_writer_matches_builder_with_multi_sequence_and_empty_docs(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    docs = [
        [rng.integers(0, 60000, size=int(n)).tolist() for n in rng.integers(0, 9, size=int(k))]
        for k in rng.integers(0, 4, size=40)
    ]
    docs = [[s for s in d if s] for d in docs]
    ref = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    ours = IndexedWriter(tmp_path / "ours", np.uint16)
    for d in docs:
        flat = [t for s in d for t in s]
        ref.add_document(flat, [len(s) for s in d])
        ours.add_batch(np.array(flat, dtype=np.int64), np.array([len(s) for s in d]), np.array([len(d)]))
    ref.finalize(str(tmp_path / "ref.idx"))
    ours.finalize()
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"ref.{ext}").read_bytes()


def test_merge_matches_add_index(tmp_path: Path, small_corpus: Path) -> None:
    preprocess([str(small_corpus)], str(tmp_path / "a"), append_eod=True, **SP_ARGS)
    preprocess([str(small_corpus)], str(tmp_path / "b"), **SP_ARGS)
    prefixes = [str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")]
    merge(prefixes, str(tmp_path / "m"))
    ref = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for p in prefixes:
        ref.add_index(p)
    ref.finalize(str(tmp_path / "ref.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"m.{ext}").read_bytes() == (tmp_path / f"ref.{ext}").read_bytes()
    assert read_index(tmp_path / "m").num_documents == 2 * len(corpus_texts())


@pytest.mark.parametrize("tok_args", [SP_ARGS, GPT2_ARGS], ids=["sentencepiece", "gpt2"])
def test_gigatoken_ids_equal_reference(tok_args: dict) -> None:
    pytest.importorskip("gigatoken")
    spec = resolve_spec(**tok_args)
    fast = build_batch_encoder(spec, 2, "gigatoken")
    ref = build_batch_encoder(spec, 2, "reference")
    texts = corpus_texts(60, 20000) + ["<s>a</s>", "<|endoftext|>", "", "  x  "]
    ft, fo = fast.encode(texts)
    rt, ro = ref.encode(texts)
    assert fast.name == "gigatoken" and ref.name != "gigatoken"
    assert np.array_equal(fo, ro) and np.array_equal(ft.astype(np.int64), rt.astype(np.int64))


def test_load_tokenizer_contract() -> None:
    from megatron.core.tokenizers import MegatronTokenizerBase

    sp = load_tokenizer(**SP_ARGS)
    assert isinstance(sp, MegatronTokenizerBase)
    assert (sp.vocab_size, sp.eod, sp.tokenize("Hello world")) == (32000, 2, [22557, 1526])
    assert sp.detokenize([22557, 1526]) == "Hello world"
    gpt2 = load_tokenizer(**GPT2_ARGS)
    assert (gpt2.vocab_size, gpt2.eod, gpt2.tokenize("Hello world")) == (50257, 50256, [15496, 995])
    assert gpt2.tokenize("<|endoftext|>") != [50256]  # GPT2BPETokenizer treats it as text
    assert "class" in gpt2.unique_identifiers


def test_hf_tokenizer_json_directory(tmp_path: Path, small_corpus: Path) -> None:
    """HuggingFaceTokenizer: a directory with tokenizer.json + tokenizer_config.json (EOS from config)."""
    import json

    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import BPE

    from pretrain.tokenizer.embedded import GPT2_MERGES, GPT2_VOCAB

    tok = Tokenizer(BPE.from_file(str(GPT2_VOCAB), str(GPT2_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|endoftext|>"])
    d = tmp_path / "hf"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    mt = load_tokenizer("HuggingFaceTokenizer", str(d))
    assert mt.eod == 50256 and mt.tokenize("a<|endoftext|>") == [64, 50256]
    preprocess([str(small_corpus)], str(tmp_path / "hf_out"), "HuggingFaceTokenizer", str(d), append_eod=True)
    ds = IndexedDataset(str(tmp_path / "hf_out_text_document"))
    assert ds[1].tolist() == mt.tokenize(corpus_texts()[1]) + [50256]
