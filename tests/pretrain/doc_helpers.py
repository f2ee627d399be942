"""Packed-document samples for the document-boundary tests (tests/pretrain/test_documents.py at CP1,
tests/pretrain/test_context_parallel.py under context parallelism): three documents preprocessed with the embedded
Mistral tokenizer (EOD appended) that together fill exactly one sample of `seq_length + 1` tokens, each also alone."""

from __future__ import annotations

import json

from tests.pretrain.ckpt_helpers import metrics

DOCS = {
    "fox": "The quick brown fox jumps over the lazy dog near the river bank.",
    "megatron": "Megatron-Core splits a transformer across tensor, pipeline and data parallel ranks; packing places "
                "several documents in one sample.",
    "code": "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",  # 71 tokens in all: sequence 70, even for SP
}
FLAGS = ["data.eod_mask_loss=true", "data.reset_position_ids=true", "data.reset_attention_mask=true"]


def prefix(tmp, name: str, texts: list[str]) -> tuple[str, list[int]]:
    """Preprocess `texts` as one dataset; its prefix and the documents' token counts (EOD included)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from data_tools.preprocess import preprocess
    from pretrain.tokenizer.embedded import MISTRAL_TOKENIZER

    src = tmp / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess([str(src)], str(tmp / name), "sentencepiece", str(MISTRAL_TOKENIZER), append_eod=True, workers=1)
    path = f"{tmp / name}_text_document"
    index = IndexedDataset(path)  # keep it alive while reading its memory-mapped lengths
    return path, [int(n) for n in index.sequence_lengths]


def case(run_dir, data_prefix: str, seq_length: int, extra: list[str] = ()) -> dict:
    """One training step on one sample of `data_prefix` (a layout_worker / ckpt_worker case)."""
    overrides = ["data.mock=false", f"data.train_blend=[{data_prefix}]", f"model.seq_length={seq_length}",
                 "train.global_batch_size=1", "train.micro_batch_size=1", "train.steps=1",
                 "checkpoint.interval=null", "checkpoint.save_at_end=false", "logging.tensorboard=false",
                 "optimizer.warmup_steps=0", f"run.dir={run_dir}", *extra]
    return {"name": str(run_dir).rsplit("/", 1)[-1], "config": "tiny_llama", "overrides": overrides}


def first_loss(run_dir) -> float:
    lines = metrics(run_dir)
    assert [x["step"] for x in lines] == [1], lines
    return lines[0]["loss"]


def documents(tmp) -> tuple[str, int, dict]:
    """(packed prefix, its sequence length, {name: (single prefix, predictions)}): every document alone and packed."""
    packed, lengths = prefix(tmp, "packed", list(DOCS.values()))
    singles = {}
    for (name, text), length in zip(DOCS.items(), lengths):
        path, (n,) = prefix(tmp, name, [text])
        assert n == length
        singles[name] = (path, n - 1)  # n tokens with EOD: n - 1 predictions
    return packed, sum(lengths) - 1, singles  # one sample holds every document whole: seq_length + 1 tokens


def weighted_mean(losses: dict[str, tuple[float, int]]) -> float:
    """Token-weighted mean of per-document (loss, predictions)."""
    return sum(loss * n for loss, n in losses.values()) / sum(n for _, n in losses.values())


def documents_alone(root, predictions: dict[str, int]) -> float:
    """The token-weighted mean of the step-1 losses of the documents trained alone (`root / doc_NAME`)."""
    return weighted_mean({d: (first_loss(root / f"doc_{d}"), n) for d, n in predictions.items()})


def assert_packed_equals_alone(root, predictions: dict[str, int], name: str, label: str = "") -> None:
    """The packed run `root / name`'s step-1 loss equals its documents trained alone (relative 1e-6)."""
    expected, got = documents_alone(root, predictions), first_loss(root / name)
    print(f"{label}{name}: packed {got:.7f}, documents alone {expected:.7f} (rel {abs(got - expected) / expected:.1e})")
    assert abs(got - expected) / expected < 1e-6
