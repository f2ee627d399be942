"""Layout equivalence on CPU (gloo): every parallel layout trains to the single-rank losses.

Same config, seed and data (the embedded corpus) at TP2+SP, PP2 (1F1B), PP2×VP2 (interleaved),
DP2 with the distributed optimizer and TP2×PP2; per-step losses within 1e-4 relative of one rank.
Step 1 runs before any update, so its equality also shows the initialisation is layout-invariant.
"""

from __future__ import annotations

import json

import pytest

from tests import tiers
from tests.pool import run_case
from tests.pool.reference import reference_run
from tests.pretrain.ckpt_helpers import log_text, metrics

pytestmark = [pytest.mark.slow, pytest.mark.mcore]

STEPS = 3
TOLERANCE = 1e-4

LLAMA_LAYOUTS = {
    2: {
        "tp2_sp": ["parallel.tensor=2", "parallel.sequence_parallel=true"],
        "pp2": ["parallel.pipeline=2"],
        "pp2_vp2": ["parallel.pipeline=2", "parallel.virtual_pipeline=2"],
        "dp2_distopt": ["optimizer.distributed=true"],
    },
    4: {
        "tp2_pp2": ["parallel.tensor=2", "parallel.pipeline=2"],
        "tp2_sp_pp2_vp2": ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2",
                           "parallel.virtual_pipeline=2"],
    },
}
# World 4 (combinations of the world-2 kinds): `make test-all` only.
FULL = {"tp2_pp2", "tp2_sp_pp2_vp2"}
# GPT: tied embeddings across pipeline stages, biases and learned positions under TP.
GPT_LAYOUTS = {
    2: {"gpt_pp2": ["parallel.pipeline=2"], "gpt_tp2_sp": ["parallel.tensor=2", "parallel.sequence_parallel=true"]},
}


def _common(dataset: str, run_dir) -> list[str]:
    return ["data.mock=false", f"data.blend=[{dataset}]", f"train.steps={STEPS}", "checkpoint.save_at_end=false",
            "checkpoint.interval=null", "logging.tensorboard=false", f"run.dir={run_dir}"]


def _losses(run_dir) -> list[float]:
    lines = metrics(run_dir)
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1)), lines
    return [x["loss"] for x in lines]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, embedded_dataset):
    base = tmp_path_factory.mktemp("layouts")
    runs = {}
    for config, suffix in (("tiny_llama", "llama"), ("tiny_gpt", "gpt")):
        overrides = _common(embedded_dataset, base / f"ref_{suffix}")
        if config == "tiny_gpt":
            overrides = _gpt_data(overrides, base)
        runs[("ref", suffix)] = reference_run(config, overrides)
    for layouts, config, suffix in ((LLAMA_LAYOUTS, "tiny_llama", "llama"), (GPT_LAYOUTS, "tiny_gpt", "gpt")):
        for world, cases in layouts.items():
            cases = tiers.pick(cases, FULL & set(cases))
            if not cases:
                continue
            spec = []
            for name, extra in cases.items():
                overrides = _common(embedded_dataset, base / name) + extra
                if config == "tiny_gpt":
                    overrides = _gpt_data(overrides, base)
                spec.append({"config": config, "overrides": overrides})
                runs[(name, suffix)] = base / name
            cases_file = base / f"{suffix}_{world}.json"
            cases_file.write_text(json.dumps(spec))
            log = base / f"{suffix}_{world}.log"
            rc = run_case(world, "tests.pretrain.layout_worker", [str(cases_file)], log, timeout=600)
            assert rc == 0, log_text(log)[-3000:]
    return runs


_GPT_DATASET: dict = {}


def _gpt_data(overrides: list[str], base) -> list[str]:
    """tiny_gpt trains on the embedded corpus tokenized with the embedded GPT-2 BPE."""
    if "prefix" not in _GPT_DATASET:
        from data_tools.assets import DEFAULT_CORPUS
        from data_tools.preprocess import preprocess
        from pretrain.tokenizer.embedded import GPT2_MERGES, GPT2_VOCAB

        out = base / "gpt2_docs"
        preprocess([str(DEFAULT_CORPUS)], str(out), "GPT2BPETokenizer", vocab_file=str(GPT2_VOCAB),
                   merge_file=str(GPT2_MERGES), append_eod=True, workers=1)
        _GPT_DATASET["prefix"] = f"{out}_text_document"
    return [o if not o.startswith("data.blend=") else f"data.blend=[{_GPT_DATASET['prefix']}]" for o in overrides]


@pytest.mark.parametrize("name,family", [pytest.param(n, f, marks=[tiers.full] if n in FULL else [])
                                         for layouts, f in ((LLAMA_LAYOUTS, "llama"), (GPT_LAYOUTS, "gpt"))
                                         for w in layouts.values() for n in w])
def test_layout_matches_single_rank(layout_runs, name, family):
    reference = _losses(layout_runs[("ref", family)])
    got = _losses(layout_runs[(name, family)])
    rel = [abs(a - b) / abs(b) for a, b in zip(got, reference)]
    print(f"{name}: losses {got} vs reference {reference}; max relative diff {max(rel):.2e}")
    assert max(rel) <= TOLERANCE, (name, got, reference)
    # Before the first update every layout computes the same function of the same weights.
    assert rel[0] <= 1e-6, (name, got[0], reference[0])
    # Training is happening, not a constant.
    assert got[-1] != got[0]
