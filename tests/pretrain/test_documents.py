"""Document boundaries in packed samples (data.eod_mask_loss, data.reset_position_ids, data.reset_attention_mask).

Three documents are preprocessed (embedded Mistral tokenizer, EOD appended) so that together they fill exactly one
sample of `seq_length + 1` tokens. With all three flags on, the trainer's step-1 loss (before any update) on that
packed sample must equal the token-weighted mean of the step-1 losses of three runs that each train on one document
alone (sequence length = that document's length, plain causal attention). Weights do not depend on the sequence
length (RoPE, initialisation by parameter name), so the runs see the same model.
"""

from __future__ import annotations

import json

import pytest

from tests.pretrain.ckpt_helpers import command, log_text, metrics, run

pytestmark = pytest.mark.slow

DOCS = {
    "fox": "The quick brown fox jumps over the lazy dog near the river bank.",
    "megatron": "Megatron-Core splits a transformer across tensor, pipeline and data parallel ranks; packing places "
                "several documents in one sample.",
    "code": "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",  # 71 tokens in all: sequence 70, even for SP
}
FLAGS = ["data.eod_mask_loss=true", "data.reset_position_ids=true", "data.reset_attention_mask=true"]


def _prefix(tmp, name: str, texts: list[str]) -> tuple[str, list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from data_tools.preprocess import preprocess
    from pretrain.tokenizer.embedded import MISTRAL_TOKENIZER

    src = tmp / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess([str(src)], str(tmp / name), "sentencepiece", str(MISTRAL_TOKENIZER), append_eod=True, workers=1)
    prefix = f"{tmp / name}_text_document"
    index = IndexedDataset(prefix)  # keep it alive while reading its memory-mapped lengths
    return prefix, [int(n) for n in index.sequence_lengths]


def _case(run_dir, prefix: str, seq_length: int, extra: list[str] = ()) -> dict:
    overrides = ["data.mock=false", f"data.train_blend=[{prefix}]", f"model.seq_length={seq_length}",
                 "train.global_batch_size=1", "train.micro_batch_size=1", "train.steps=1",
                 "checkpoint.interval=null", "checkpoint.save_at_end=false", "logging.tensorboard=false",
                 "optimizer.warmup_steps=0", f"run.dir={run_dir}", *extra]
    return {"config": "tiny_llama", "overrides": overrides}


def _first_loss(run_dir) -> float:
    lines = metrics(run_dir)
    assert [x["step"] for x in lines] == [1], lines
    return lines[0]["loss"]


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("documents")
    packed, lengths = _prefix(tmp, "packed", list(DOCS.values()))
    seq = sum(lengths) - 1  # one sample holds every document whole: seq_length + 1 tokens
    cases, singles = [], {}
    for (name, text), length in zip(DOCS.items(), lengths):
        prefix, (n,) = _prefix(tmp, name, [text])
        assert n == length
        singles[name] = (tmp / f"run_{name}", n - 1)  # n tokens with EOD: n - 1 predictions
        cases.append(_case(tmp / f"run_{name}", prefix, n - 1))
    cases.append(_case(tmp / "packed_flags", packed, seq, FLAGS))
    cases.append(_case(tmp / "packed_plain", packed, seq))
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    rc = run(command([], module="tests.pretrain.layout_worker", args=[str(spec)]), tmp / "world1.log", timeout=600)
    assert rc == 0, log_text(tmp / "world1.log")[-3000:]
    # The same packed sample with the mask split by tensor parallelism (+SP) and passed to both pipeline stages.
    two = [_case(tmp / "packed_tp2", packed, seq, FLAGS + ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
           _case(tmp / "packed_pp2", packed, seq, FLAGS + ["parallel.pipeline=2"])]
    spec2 = tmp / "cases2.json"
    spec2.write_text(json.dumps(two))
    rc = run(command([], nproc=2, module="tests.pretrain.layout_worker", args=[str(spec2)]), tmp / "world2.log",
             timeout=600)
    assert rc == 0, log_text(tmp / "world2.log")[-3000:]
    return tmp, singles


def test_packed_loss_is_token_weighted_mean_of_documents(packed_runs):
    tmp, singles = packed_runs
    per_doc = {name: (_first_loss(d), n) for name, (d, n) in singles.items()}
    expected = sum(loss * n for loss, n in per_doc.values()) / sum(n for _, n in per_doc.values())
    packed = _first_loss(tmp / "packed_flags")
    plain = _first_loss(tmp / "packed_plain")
    print(f"per-document (loss, predictions): {per_doc}; weighted mean {expected:.7f}; packed with boundaries "
          f"{packed:.7f} (rel diff {abs(packed - expected) / expected:.1e}); packed without {plain:.7f}")
    assert abs(packed - expected) / expected < 1e-6
    # Without the flags documents attend across boundaries and the EOD→next-document predictions count (an
    # untrained model's loss is near ln(vocabulary) whatever it attends to, hence the small but clear gap).
    assert abs(plain - expected) / expected > 1e-4


@pytest.mark.parametrize("layout", ["packed_tp2", "packed_pp2"])
def test_packed_boundaries_hold_across_layouts(packed_runs, layout):
    tmp, _ = packed_runs
    one, got = _first_loss(tmp / "packed_flags"), _first_loss(tmp / layout)
    print(f"{layout}: {got:.7f} vs one rank {one:.7f}")
    assert abs(got - one) / one < 1e-6
