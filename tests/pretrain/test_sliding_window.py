"""Sliding-window attention on CPU (gloo), through `train()`: layouts against one rank, documents against documents
alone, the validate refusals.

`tiny_mistral_swa` (window 32 < sequence 128) with `model.window_attn_skip_freq=2` (layers 2 and 4 full, 1 and 3
windowed) trains 4 steps (fp32, the embedded corpus); at one rank Megatron-Core's own `DotProductAttention` applies
the window, under CP our `ContextParallelAttention` (`model_providers/core/cp_attention.py`) masks by it. Each
layout must give the one-rank losses and gradient norms to 1e-5 relative: `make test` runs CP2 with the p2p ring
(whose zigzag chunks of 32 tokens a window of 32 cuts across); `make test-all` adds all_gather, a2a, TP2+SP and PP2
(the layer pattern across stages), and packed documents (THD) with a window of 8 tokens, shorter than each
document, which give the token-weighted mean of the documents trained alone (Megatron's window mask) at CP1 and
CP2 (p2p, a2a). Two pool cases (world 1 and world 2).
"""

from __future__ import annotations

import pytest

from pretrain.config import load_config
from pretrain.validate import validate
from tests import tiers
from tests.pretrain.ckpt_helpers import max_rel, run_worker_cases, step_values
from tests.pretrain.doc_helpers import FLAGS, assert_packed_equals_alone, case, documents

pytestmark = pytest.mark.slow

STEPS = 4
TOLERANCE = 1e-5
SWA = ["model.preset=tiny_mistral_swa", "model.family=mistral", "model.window_attn_skip_freq=2"]
CP2 = ["parallel.context=2"]
# name: (world, overrides)
LAYOUTS = {
    "cp2_p2p": (2, CP2 + ["parallel.cp_comm_type=p2p"]),
    "cp2_all_gather": (2, CP2 + ["parallel.cp_comm_type=all_gather"]),
    "cp2_a2a": (2, CP2 + ["parallel.cp_comm_type=a2a"]),
    "tp2_sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pipeline=2"]),
}
DOC_WINDOW = ["model.sliding_window=8"]
DOC_LAYOUTS = {"docs_cp1": [], "docs_cp2_p2p": CP2, "docs_cp2_a2a": CP2 + ["parallel.cp_comm_type=a2a"]}
# `make test` runs the reference and CP2 p2p (two train() calls); the window mask of packed documents is checked in
# process there (tests/model_providers/test_cp_attention.py), through train() here in `make test-all`.
FULL = {"cp2_all_gather", "cp2_a2a", "tp2_sp", "pp2", "docs_cp1", "docs_cp2_p2p", "docs_cp2_a2a"}


def _common(dataset: str, run_dir) -> list[str]:
    return [*SWA, "data.mock=false", f"data.blend=[{dataset}]", f"train.steps={STEPS}", "train.precision=fp32",
            "train.global_batch_size=4", "train.micro_batch_size=2", "checkpoint.save_at_end=false",
            "checkpoint.interval=null", "logging.tensorboard=false", f"run.dir={run_dir}"]


@pytest.fixture(scope="module")
def swa_runs(tmp_path_factory, embedded_dataset):
    """Every case of this file: the world-1 pool case (the reference, documents alone and packed at CP1) and the
    world-2 one (the layouts, packed documents at CP2). Returns (root, documents' prediction counts)."""
    root = tmp_path_factory.mktemp("swa")
    by_world: dict[int, list[dict]] = {1: [], 2: []}
    by_world[1].append({"name": "ref", "config": "tiny_llama", "overrides": _common(embedded_dataset, root / "ref")})
    for name, (world, extra) in tiers.pick(LAYOUTS, FULL & set(LAYOUTS)).items():
        by_world[world].append({"name": name, "config": "tiny_llama",
                                "overrides": _common(embedded_dataset, root / name) + extra})
    singles = {}
    doc_layouts = tiers.pick(DOC_LAYOUTS, FULL & set(DOC_LAYOUTS))
    if doc_layouts:
        packed, seq, singles = documents(root)
        for name, (path, n) in singles.items():  # a document alone: a sample of its n predictions
            by_world[1].append(case(root / f"doc_{name}", path, n, DOC_WINDOW))
        for name, extra in doc_layouts.items():
            world = 2 if "parallel.context=2" in extra else 1
            by_world[world].append(case(root / name, packed, seq, FLAGS + DOC_WINDOW + extra))
    for world, cases in by_world.items():
        (root / f"w{world}").mkdir()
        run_worker_cases(root / f"w{world}", world, cases, timeout=900)
    return root, {name: n for name, (_, n) in singles.items()}


@pytest.mark.mcore
@pytest.mark.parametrize("name", tiers.params(LAYOUTS, FULL))
def test_windowed_layout_matches_one_rank(swa_runs, name):
    root, _ = swa_runs
    loss = max_rel(step_values(root / name, "loss"), step_values(root / "ref", "loss"))
    norm = max_rel(step_values(root / name, "grad_norm"), step_values(root / "ref", "grad_norm"))
    print(f"| tiny_mistral_swa (window 32, skip 2) | {name} | {loss:.1e} | {norm:.1e} |")
    assert len(step_values(root / name, "loss")) == STEPS
    assert loss <= TOLERANCE and norm <= TOLERANCE, (name, loss, norm)


@pytest.mark.parametrize("name", tiers.params(DOC_LAYOUTS, FULL))
def test_windowed_packed_documents_equal_documents_alone(swa_runs, name):
    """THD with a window of 8 (our attention's window mask) = each document alone (Megatron's window mask)."""
    root, predictions = swa_runs
    assert_packed_equals_alone(root, predictions, name)


REFUSED = {
    "skip without window": (["model.window_attn_skip_freq=2"], 1, "[model.window_attn_skip_freq, "
                            "model.sliding_window] model.window_attn_skip_freq chooses the layers of a sliding "
                            "window, but model.sliding_window is null"),
    "pattern length": (SWA[:2] + ["model.window_attn_skip_freq=[1,0]"], 1, "model.window_attn_skip_freq must list 0 "
                       "(full) or 1 (windowed) for each of the model.num_layers=4 layers; got [1, 0]"),
    "pattern with MTP": (SWA[:2] + ["model.window_attn_skip_freq=[1,0,1,0]", "model.mtp_num_layers=1"], 1,
                         "a per-layer model.window_attn_skip_freq list has no entry for the Multi-Token Prediction"),
}


def test_window_keys_are_validated():
    """Each bad combination is one problem naming its keys; the window and its pattern are accepted on CPU at CP2
    with every comm type (Transformer Engine's p2p refusal is in test_feature_combinations' GPU dry run)."""
    for case_name, (overrides, world, message) in REFUSED.items():
        report = validate(load_config("tiny_llama", ["data.mock=true", *overrides]), world)
        assert [str(p) for p in report.errors if message in str(p)], (case_name, [str(p) for p in report.errors])
    for comm in ("p2p", "all_gather", "a2a"):
        cfg = load_config("tiny_llama", ["data.mock=true", *SWA, *CP2, f"parallel.cp_comm_type={comm}"])
        assert not validate(cfg, 2, te_on_gpu=False).errors, comm
    cfg = load_config("tiny_llama", ["data.mock=true", *SWA, *CP2, "parallel.cp_comm_type=p2p"])
    errors = [str(p) for p in validate(cfg, 2, te_on_gpu=True).errors]
    assert any("only with cp_comm_type a2a or all_gather, not p2p" in e for e in errors), errors


def test_windowed_flops_count_the_keys_a_query_sees():
    """The attention term of the FLOPs (pretrain/observe/flops.py) counts the (query, key) pairs of the window mask,
    less half the diagonal as Megatron counts causal attention (s²/2): the s×W term on windowed layers, s²/2 on full
    ones; a window covering the sequence is full attention."""
    from pretrain.observe.flops import flops_per_token

    def flops(*extra: str) -> float:
        return flops_per_token(load_config("tiny_llama", ["model.seq_length=128", *extra]).model, 32000)

    s, w, layers, width = 128, 32, 4, 8 * 16  # tiny_llama: 4 layers, 8 heads of 16
    pairs = sum(min(i + 1, w) for i in range(s)) - s / 2  # per windowed layer and sequence
    per_pair = 12 * width  # QK^T and scores·V, forward and backward: 2·2·3 FLOPs per pair and head dim
    full = flops()
    assert flops("model.sliding_window=128") == full
    assert flops("model.sliding_window=32") == pytest.approx(full - layers * per_pair * (s * s / 2 - pairs) / s)
    assert flops("model.sliding_window=32", "model.window_attn_skip_freq=2") == pytest.approx(
        full - 2 * per_pair * (s * s / 2 - pairs) / s)
