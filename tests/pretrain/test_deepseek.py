"""DeepSeek-V3-class training through the trainer (tiny_deepseek: MLA with q/KV LoRA and YaRN, a dense first layer,
8 routed experts + 1 shared, sigmoid top-2 within 1 of 2 groups with the expert bias, MTP depth 1; fp32, CPU).

Every layout trains to the one-rank losses per step (≤ 1e-5 relative), with the same MTP loss and load-balancing
loss; the expert-bias vectors (aux-loss-free balancing, updated every step from the routed counts) are identical
while routing is, and after a near-tie routing decision flips (TP splits reductions, changing rounding) differ
entry by entry by at most one update per step since; checkpoints saved at EP2 resume at EP1 and on one rank with
the same next losses and the saved bias; `kill -9` + resume reproduces every logged number exactly; the
aux-loss-free bias moves a deliberately skewed router's load toward balance; the model trained at TP2 × PP2 × EP2
exports to transformers, which computes our loss.

Launches: world 1 (the reference), world 2 (EP layouts and the EP2 → EP1 resume; the `mcore` subset, run again on
megatron-core 0.19.2), world 4 (pipelined layouts), world 1 again (EP2 → one rank, the skewed router).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests import tiers
from tests.data_tools.test_convert import tokenizer_dir  # noqa: F401  (fixture: the embedded tokenizer, HF style)
from tests.pretrain.ckpt_helpers import (
    DETERMINISTIC,
    by_step,
    command,
    kill9_and_resume,
    layout_case,
    metrics,
    rel_diff,
    run_worker_cases,
)

pytestmark = pytest.mark.slow

CONFIG = "tiny_deepseek"
STEPS = 4
TOLERANCE = 1e-5
RATE = 1e-3  # tiny_deepseek's moe_router_bias_update_rate
SEQ = 64
BASE = ["data.mock=true", f"model.seq_length={SEQ}", f"train.steps={STEPS}", "checkpoint.save_at_end=false",
        "checkpoint.interval=null", "logging.tensorboard=false", "optimizer.warmup_steps=1"]
EP2 = ["parallel.expert=2"]
TP2_EP2 = ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2", "parallel.expert_tensor=1"]
DIST = ["optimizer.distributed=true"]
SOURCE = ["checkpoint.interval=2"]
LOSSES = ("loss", "mtp_loss", "moe_seq_load_balancing_loss")

# name: (world, overrides, copy_from source or None)
CORE = {  # the megatron-core subset (also on 0.19.2)
    "ep2": (2, EP2 + SOURCE, None),  # also the kill -9 test's reference
    "tp2_sp_ep2": (2, TP2_EP2, None),
    "dp2_distopt_ep2": (2, DIST + EP2 + SOURCE, None),
    "distopt_ep2_to_ep1": (2, DIST, "dp2_distopt_ep2"),
}
MORE = {
    "pp2_ep2": (4, ["parallel.pipeline=2"] + EP2, None),  # MTP on the last stage, its embedding copy tied
    "tp2_pp2_ep2": (4, TP2_EP2 + ["parallel.pipeline=2", "checkpoint.save_at_end=true"], None),
    "ep2_to_one_rank": (1, [], "ep2"),
}
RESHARD = {"distopt_ep2_to_ep1": "dp2_distopt_ep2", "ep2_to_one_rank": "ep2"}


def _case(root, name: str, overrides: list[str], source: str | None) -> dict:
    return layout_case(root, CONFIG, BASE, name, overrides, source)


@pytest.fixture(scope="module")
def core_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    started = time.perf_counter()
    reference = {"name": "ref", "config": CONFIG,
                 "overrides": BASE + [f"run.dir={root}/ref", "logging.tensorboard=true"]}
    run_worker_cases(root, 1, [reference], timeout=900)
    run_worker_cases(root, 2, [_case(root, n, o, s) for n, (_, o, s) in CORE.items()], timeout=900)
    print(f"DeepSeek core runs: {time.perf_counter() - started:.0f} s")
    return root


@pytest.fixture(scope="module")
def more_runs(core_runs, tokenizer_dir):  # noqa: F811
    root = core_runs
    started = time.perf_counter()
    if tiers.everything():  # the world-4 layouts: `make test-all` only
        run_worker_cases(root, 4, [_case(root, n, o, s) for n, (w, o, s) in MORE.items() if w == 4], timeout=900)
    ones = [_case(root, n, o, s) for n, (w, o, s) in MORE.items() if w == 1] + _skewed_cases(root, tokenizer_dir)
    run_worker_cases(root, 1, ones, timeout=900)
    print(f"DeepSeek pipelined, resharding and skewed-router runs: {time.perf_counter() - started:.0f} s")
    return root


def _bias_agrees(got: dict[int, dict], ref: dict[int, dict], steps) -> str:
    """Expert bias vectors: identical while the routing (tokens per expert) is; after the first step that routes
    differently, each entry within one update (the rate) per step since. Returns a summary."""
    diverged = None
    for s in steps:
        if diverged is None and got[s]["moe_tokens_per_expert"] != ref[s]["moe_tokens_per_expert"]:
            diverged = s
        allowed = 0.0 if diverged is None else RATE * (s - diverged + 1) * (1 + 1e-6)
        for a, b in zip(got[s]["moe_expert_bias"], ref[s]["moe_expert_bias"]):
            assert (a is None) == (b is None)
            if a is not None:
                assert max(abs(x - y) for x, y in zip(a, b)) <= allowed, (s, diverged, a, b)
    return "identical" if diverged is None else f"identical to step {diverged - 1}, then within one update per step"


def _layout(root, name: str) -> None:
    ref, got = by_step(root / "ref"), by_step(root / name)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    rel = {k: max(rel_diff(got[s][k], ref[s][k]) for s in ref) for k in LOSSES}
    bias = _bias_agrees(got, ref, sorted(ref))
    print(f"{name}: losses {[got[s]['loss'] for s in sorted(got)]}; max relative diff: loss {rel['loss']:.2e}, "
          f"MTP loss {rel['mtp_loss']:.2e}, balance loss {rel['moe_seq_load_balancing_loss']:.2e}; expert bias {bias}")
    assert max(rel.values()) <= TOLERANCE, rel
    assert rel_diff(got[1]["loss"], ref[1]["loss"]) <= 1e-6  # the same function of the same (layout-invariant) weights
    assert got[1]["moe_tokens_per_expert"] == ref[1]["moe_tokens_per_expert"]  # the same routing
    assert got[STEPS]["loss"] != got[1]["loss"] and got[STEPS]["moe_expert_bias"] != got[1]["moe_expert_bias"]


@pytest.mark.mcore
@pytest.mark.parametrize("name", [n for n, (_, _, s) in CORE.items() if s is None])
def test_layout_matches_single_rank(core_runs, name):
    _layout(core_runs, name)


@pytest.mark.full  # world 4; `make test` runs DeepSeek at PP2 with its MTP layer in test_hf_families
@pytest.mark.parametrize("name", [n for n, (w, _, s) in MORE.items() if s is None])
def test_pipelined_layout_matches_single_rank(more_runs, name):
    _layout(more_runs, name)


def _resharded(root, name: str) -> None:
    source = RESHARD[name]
    ref, got = by_step(root / source), by_step(root / name)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in (3, 4):
        assert got[s]["consumed_samples"] == ref[s]["consumed_samples"] and got[s]["lr"] == ref[s]["lr"]
        rel = max(rel_diff(got[s][k], ref[s][k]) for k in ("loss", "mtp_loss"))
        print(f"{name} step {s}: loss {got[s]['loss']!r} vs {ref[s]['loss']!r} ({source}), max relative diff "
              f"(loss, MTP loss) {rel:.2e}")
        assert rel <= 2e-6, (s, got[s], ref[s])
    # The bias was loaded: step 3 starts from the saved step-2 bias (a fresh bias would be ±1 update from zero).
    _bias_agrees(got, ref, (3, 4))
    assert max(abs(x) for row in ref[3]["moe_expert_bias"] if row for x in row) > 2 * RATE


@pytest.mark.mcore
def test_expert_parallel_checkpoint_resumes_at_ep1(core_runs):
    _resharded(core_runs, "distopt_ep2_to_ep1")


def test_ep2_checkpoint_resumes_on_one_rank(more_runs):
    _resharded(more_runs, "ep2_to_one_rank")


@pytest.mark.mcore
def test_mtp_loss_expert_load_and_bias_in_metrics_jsonl_and_tensorboard(core_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = by_step(core_runs / "ref")
    layers, experts = 4 + 1, 8  # decoder layers and the MTP layer
    for record in lines.values():
        assert record["mtp_loss"] > 0 and record["mtp_loss_per_layer"] == [record["mtp_loss"]]
        counts, bias = record["moe_tokens_per_expert"], record["moe_expert_bias"]
        assert len(counts) == len(bias) == layers and bias[0] is None and counts[0] == [0] * experts  # dense
        assert all(len(row) == experts and sum(row) == 8 * SEQ * 2 for row in counts[1:])  # dropless, top-2
        assert record["moe_max_over_mean_load_per_layer"][0] == 0.0
        assert record["moe_expert_bias_range"] == pytest.approx(max(max(b) - min(b) for b in bias[1:]))
        assert record["moe_expert_bias_min"] == min(min(b) for b in bias[1:])
        # Each step moves each entry by ± the rate (0 for an expert loaded exactly at the mean).
        step = record["step"]
        assert all(abs(x) <= RATE * step * (1 + 1e-6) for row in bias[1:] for x in row)
    events = EventAccumulator(str(core_runs / "ref" / "tensorboard"))
    events.Reload()
    for key in ("mtp_loss", "moe_expert_bias_range", "moe_expert_bias_min", "moe_expert_bias_max",
                "moe_max_over_mean_load", "moe_seq_load_balancing_loss"):
        values = [e.value for e in events.Scalars(f"train/{key}")]
        assert values == pytest.approx([lines[s][key] for s in sorted(lines)]), key


@pytest.mark.full  # kill -9 at another layout; `make test` has test_resume.py's
def test_kill9_and_resume_reproduce_every_number_at_ep2(core_runs, tmp_path):
    work = tmp_path / "run"
    cmd = command([], nproc=2, args=["train", CONFIG, *BASE, *EP2, "checkpoint.interval=1", f"run.dir={work}"])
    kill_at = kill9_and_resume(cmd, work, STEPS)
    keys = DETERMINISTIC + ("mtp_loss", "moe_seq_load_balancing_loss", "moe_tokens_per_expert", "moe_expert_bias")
    got = [tuple(json.dumps(m[k]) for k in keys) for m in metrics(work) if "loss" in m]
    want = [tuple(json.dumps(m[k]) for k in keys) for m in metrics(core_runs / "ep2") if "loss" in m]
    print(f"killed after step {kill_at}; {len(got)} steps compared exactly (losses, MTP loss, routing, expert bias)")
    assert len(got) == STEPS and got == want


# --------------------------------------------------------------------------------------------------
# Aux-loss-free balancing on a deliberately skewed router
# --------------------------------------------------------------------------------------------------

SKEW, SKEW_RATE, SKEW_STEPS = 0.3, 0.05, 6


def _skewed_cases(root, tokenizer) -> list[dict]:
    """A random transformers DeepSeek-V3 whose expert bias (`e_score_correction_bias`) favours experts 0 and 1
    by 0.3 in every MoE layer (their group wins every token), imported, then trained with the bias update on
    (rate 0.05) and the learning rate 0: only the bias changes, so any change of the load is the bias's doing."""
    from data_tools.convert import main as convert
    from tests.data_tools.hf_families import write_hf_model

    def skew(name: str, tensor: torch.Tensor) -> torch.Tensor:  # the router at its random scale, the bias skewed
        if name.endswith("e_score_correction_bias"):
            return torch.tensor([SKEW, SKEW] + [0.0] * (tensor.numel() - 2))
        return tensor

    src = write_hf_model("deepseek_v3", root / "hf_skewed", {"sentencepiece": tokenizer}, edit=skew)
    assert convert(["from-hf", "--hf", str(src), "--output", str(root / "ckpt_skewed"), "--no-progress",
                    "model.seq_length=64"]) == 0
    overrides = ["data.mock=true", f"train.steps={SKEW_STEPS}", "checkpoint.save_at_end=false", "optimizer.lr=0",
                 "optimizer.min_lr=0", "optimizer.warmup_steps=0", "logging.tensorboard=false",
                 f"checkpoint.pretrained={root / 'ckpt_skewed'}", "train.global_batch_size=8",
                 "train.micro_batch_size=4", f"model.moe_router_bias_update_rate={SKEW_RATE}", f"run.dir={root}/skewed"]
    return [{"name": "skewed", "config": str(root / "ckpt_skewed" / "run_config.yaml"), "overrides": overrides}]


def test_expert_bias_moves_a_skewed_router_toward_balance(more_runs):
    runs = by_step(more_runs / "skewed")
    steps = sorted(runs)
    assert steps == list(range(1, SKEW_STEPS + 1))
    load = [runs[s]["moe_max_over_mean_load"] for s in steps]
    print(f"most loaded expert / mean, worst layer, per step (lr 0, bias update {SKEW_RATE}): "
          f"{[round(x, 3) for x in load]}")
    # Skewed: experts 0 and 1 take (nearly) every token at first, 4× the mean of 8 experts at top-2.
    assert load[0] >= 3.9
    # The bias alone brings the load near balance (1.0) within a few steps (and, at this large rate, overshoots).
    assert min(load) < 0.4 * load[0] and load[-1] < load[0]
    # Every step, every MoE layer: bias += rate · sign(mean load − expert load), from the logged global counts.
    previous = [[SKEW, SKEW] + [0.0] * 6 if row is not None else None for row in runs[1]["moe_expert_bias"]]
    for step in steps:
        record = runs[step]
        for layer, (bias, counts) in enumerate(zip(record["moe_expert_bias"], record["moe_tokens_per_expert"])):
            if bias is None:
                continue
            mean = sum(counts) / len(counts)
            want = [b + SKEW_RATE * ((mean > c) - (mean < c)) for b, c in zip(previous[layer], counts)]
            assert bias == pytest.approx(want, abs=1e-6), (step, layer)
            previous[layer] = bias


# --------------------------------------------------------------------------------------------------
# Export of a model trained at TP2 × PP2 × EP2
# --------------------------------------------------------------------------------------------------


@pytest.mark.full  # the world-4 run; `make test` exports DeepSeek from TP2 in test_hf_families
def test_trained_at_tp2_pp2_ep2_exports_and_transformers_computes_our_loss(more_runs, tmp_path):
    from torch.nn.functional import cross_entropy

    from tests.data_tools.test_convert import exported_logits

    config, ours, theirs = exported_logits(more_runs / "tp2_pp2_ep2", tmp_path, length=64)
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert config["first_k_dense_replace"] == 1 and config["n_group"] == 2 and config["topk_group"] == 1
    labels = torch.randint(0, config["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(2))
    loss = [cross_entropy(x.reshape(-1, x.shape[-1]), labels.reshape(-1)).item() for x in (ours, theirs)]
    diff = (ours - theirs).abs().max().item()
    print(f"trained at TP2×PP2×EP2 (4 ranks): loss ours {loss[0]:.6f}, transformers {loss[1]:.6f} (relative diff "
          f"{rel_diff(loss[1], loss[0]):.2e}); logits max abs diff {diff:.2e}")
    assert rel_diff(loss[1], loss[0]) <= 1e-5 and diff <= 1e-4
