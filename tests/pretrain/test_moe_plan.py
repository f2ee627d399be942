"""The planner on MoE models: total and active parameters from first principles (and transformers), FLOPs per
token from the active parameters, per-rank memory with expert parallelism (experts split over EP, their
optimizer state over expert DP), the token all-to-all in the cost model, and the shipped Qwen3-30B-A3B layout."""

from __future__ import annotations

import math

import pytest

from pretrain import plan
from pretrain.config import load_config
from pretrain.observe.flops import flops_per_token
from pretrain.planner.constants import value

A2A = value("nvlink_a2a_efficiency")  # the all-to-all's share of NVLink bandwidth (planner/constants.py)


def first_principles(preset: str) -> tuple[int, int, int]:
    """(total, active, active GEMM) parameters of a Llama-like MoE preset, counted by hand."""
    m = load_config(None, [f"model.preset={preset}"]).model
    h, a, g, L, V = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.num_layers, m.vocab_size
    d = m.kv_channels or h // a
    fe = m.moe_ffn_hidden_size or m.ffn_hidden_size
    attention = h * a * d + 2 * h * g * d + a * d * h  # q, k, v, o
    expert = 3 * h * fe  # gate, up, down
    norms = 2 * h + (2 * d if m.qk_layernorm else 0)
    router = m.num_moe_experts * h
    embeddings = 2 * V * h  # untied
    total = embeddings + h + L * (attention + norms + router + m.num_moe_experts * expert)
    active = embeddings + h + L * (attention + norms + router + m.moe_router_topk * expert)
    gemm = V * h + L * (attention + router + m.moe_router_topk * expert)  # the embedding lookup is not a GEMM
    return total, active, gemm


@pytest.mark.parametrize("preset,total_b,active_b", [("mixtral_8x7b", "46.7", "12.9"), ("qwen3_30b_a3b", "30.5", "3.3"),
                                                     ("qwen3_235b_a22b", "235", "22")])
def test_total_and_active_parameters(preset, total_b, active_b):
    cfg = load_config(None, [f"model.preset={preset}"])
    total, active, _ = first_principles(preset)
    vocab = cfg.model.vocab_size
    assert plan.count_parameters(cfg, vocab) == total
    assert plan.count_active_parameters(cfg, vocab) == active
    digits = len(total_b.split(".")[1]) if "." in total_b else 0
    print(f"{preset}: {total:,} parameters ({total / 1e9:.{digits}f}B), {active:,} active ({active / 1e9:.2f}B)")
    assert f"{total / 1e9:.{digits}f}" == total_b
    # Active counts as published: Mistral rounds (12.88B -> "12.9B"), Qwen truncates (3.35B -> "3.3B", 22.19B ->
    # "22B"); the figure is one of the two.
    digits = len(active_b.split(".")[1]) if "." in active_b else 0
    truncated = f"{math.floor(active / 10 ** (9 - digits)) / 10 ** digits:.{digits}f}"
    assert active_b in (f"{active / 1e9:.{digits}f}", truncated)


@pytest.mark.parametrize("preset", ["mixtral_8x7b", "qwen3_30b_a3b"])
def test_flops_per_token_come_from_the_active_parameters(preset):
    """6 FLOPs per active GEMM parameter and token (forward + backward), plus causal attention's scores."""
    m = load_config(None, [f"model.preset={preset}"]).model
    _, _, gemm = first_principles(preset)
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    expected = 6 * gemm + 6 * m.num_layers * m.seq_length * m.num_attention_heads * d
    assert flops_per_token(m, m.vocab_size) == pytest.approx(expected, rel=1e-12)


def _static(overrides: list[str], world: int):
    cfg = load_config(None, ["model.preset=qwen3_30b_a3b", "train.precision=bf16", "optimizer.distributed=true",
                             "train.global_batch_size=256", *overrides])
    lay = plan.layout_of(cfg, world, on_gpu=True, use_te=True)
    return cfg, lay, plan.static_memory(cfg, lay, plan.padded_vocab_for(cfg), 0)


def test_expert_parallel_splits_experts_and_expert_data_parallel_their_optimizer():
    per_expert_layer = 3 * 2048 * 768
    # 16 GPUs, PP2: EP8 (EDP1) holds 16 experts of each of its 24 layers; EP4 (EDP2) 32, optimizer sharded in two.
    _, lay8, ep8 = _static(["parallel.pipeline=2", "parallel.expert=8", "parallel.expert_tensor=1"], 16)
    _, lay4, ep4 = _static(["parallel.pipeline=2", "parallel.expert=4", "parallel.expert_tensor=1"], 16)
    assert (lay8.edp, lay4.edp) == (1, 2)
    assert ep8.expert_params == 24 * 16 * per_expert_layer and ep4.expert_params == 2 * ep8.expert_params
    dense = ep8.params - ep8.expert_params
    assert ep4.params - ep4.expert_params == dense
    # Adam moments + fp32 main parameters (12 bytes) of the rank's shard: dense over DP8, experts over EDP.
    assert ep8.optimizer == pytest.approx(12 * (dense / 8 + ep8.expert_params), rel=1e-3)
    assert ep4.optimizer == pytest.approx(12 * (dense / 8 + ep4.expert_params / 2), rel=1e-3)
    # Expert TP 2 at EP4 (EDP1) halves each expert instead.
    _, _, etp2 = _static(["parallel.pipeline=2", "parallel.expert=4", "parallel.expert_tensor=2",
                          "parallel.tensor=2", "parallel.sequence_parallel=true"], 16)
    assert etp2.expert_params == ep8.expert_params


def test_all_to_all_volume_and_the_shipped_layout():
    """launch/pretrain_moe.sh's layout (2 nodes x 8 H100: PP2 × EP8, expert TP 1) fits and plans its all-to-all:
    per layer and microbatch 4 all-to-alls of (EP−1)/EP of the rank's T·k token copies of h values."""
    cfg = load_config("qwen3_30b_a3b", ["parallel.pipeline=2", "parallel.expert=8", "parallel.expert_tensor=1",
                                        "train.global_batch_size=256", "train.micro_batch_size=1"])
    p = plan.make_plan(cfg, nodes=2, gpus_per_node=8, gpu="h100")
    assert p["fits"] and p["moe"]["experts_per_rank"] == 16 and p["moe"]["expert_data_parallel"] == 1
    tokens, k, h, layers, microbatches = 4096, 8, 2048, 24, 32
    per_layer = 4 * tokens * k * h * 2 * 7 / 8
    assert p["moe"]["all_to_all_bytes_per_step"] == int(microbatches * layers * per_layer)
    assert p["cost_model"]["ep_comm_s"] == pytest.approx(p["moe"]["all_to_all_bytes_per_step"] / (450e9 * A2A))
    assert p["num_parameters"] == first_principles("qwen3_30b_a3b")[0]
    text = plan.format_plan(p)
    assert "experts    128 per layer, top-8; ETP1 × EP8 × EDP1: 16 experts per rank" in text
    assert "active per token" in text and " + EP " in text


MIXTRAL_2X8 = ["model.preset=mixtral_8x7b", "parallel.pipeline=2", "parallel.expert=8", "parallel.expert_tensor=1",
               "train.precision=bf16", "optimizer.distributed=true", "train.global_batch_size=256",
               "train.micro_batch_size=1"]


def test_mixtral_plan_from_the_command_line():
    """`python -m pretrain plan` for Mixtral 8x7B on 2 × 8 H100 (PP2 × EP8: one expert per rank): the parameter
    counts, the rank's experts and optimizer shard, and the all-to-all bytes, each from first principles."""
    import json
    from pathlib import Path

    from tests.cli import Result, run_cli

    root = Path(__file__).resolve().parents[2]

    def run(*args: str) -> Result:
        return run_cli("pretrain", ["plan", "tiny_moe", *MIXTRAL_2X8, *args, "--nodes", "2", "--gpus-per-node", "8"],
                       cwd=root)

    out = run("--json")
    assert out.rc == 0, out.stderr
    p = json.loads(out.stdout)
    total, active, _ = first_principles("mixtral_8x7b")
    assert (p["num_parameters"], p["num_active_parameters"]) == (total, active)
    h, f, layers = 4096, 14336, 16  # per pipeline stage
    assert p["moe"]["experts_per_rank"] == 1 and p["moe"]["expert_parameters_on_rank"] == layers * 3 * h * f
    # bf16 weights and grads (2 + 2 bytes... grads fp32 in DDP: 4), Adam moments + fp32 main params (12 bytes) of
    # the dense part sharded over DP8 and the experts over EDP1.
    on_rank = p["most_loaded_rank"]["parameters"]
    experts = p["moe"]["expert_parameters_on_rank"]
    stage0 = p["stages"][0]
    assert stage0["weights"] * 2**30 == pytest.approx(2 * on_rank, rel=1e-3)
    assert stage0["optimizer"] * 2**30 == pytest.approx(12 * ((on_rank - experts) / 8 + experts), rel=1e-3)
    # 4 all-to-alls per layer and microbatch (dispatch, combine; forward, backward) of 7/8 of T·k·h bf16 values.
    assert p["moe"]["all_to_all_bytes_per_step"] == int(32 * layers * 4 * 4096 * 2 * h * 2 * 7 / 8)
    text = run().stdout
    assert f"{total:,} parameters, {active:,} active per token (27.6%)" in text
    assert "experts    8 per layer, top-2; ETP1 × EP8 × EDP1: 1 expert per rank" in text
    # Selective recompute of the MoE layers runs their forward all-to-alls again: 6 instead of 4 per layer.
    again = json.loads(run("model.recompute_granularity=selective", "model.recompute_modules=[moe]", "--json").stdout)
    assert again["moe"]["all_to_all_bytes_per_step"] == p["moe"]["all_to_all_bytes_per_step"] * 3 // 2
    assert again["stages"][0]["activations"] < stage0["activations"]
    print(f"mixtral_8x7b PP2×EP8 on 16 H100: {p['memory_gib']['total']:.2f} GiB/GPU, all-to-all "
          f"{p['moe']['all_to_all_bytes_per_step'] / 1e9:.2f} GB/step/rank, EP {p['cost_model']['ep_comm_s']:.2f} s")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_launch_script_layout_fits_as_planned(precision):
    """What `sbatch launch/pretrain_moe.sh` passes (its LAUNCH_PRINT_OVERRIDES mode), planned by the command line
    for 2 × 8 H100: it fits, with 16 experts per rank and the all-to-all on NVLink."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from tests.cli import run_cli

    root = Path(__file__).resolve().parents[2]
    printed = subprocess.run(["bash", str(root / "launch/pretrain_moe.sh")], capture_output=True, text=True,
                             timeout=30, env={**os.environ, "LAUNCH_PRINT_OVERRIDES": "1", "PRECISION": precision})
    assert printed.returncode == 0, printed.stderr
    config, *overrides = printed.stdout.split()
    out = run_cli("pretrain", ["plan", config, *overrides, "--nodes", "2", "--gpus-per-node", "8", "--gpu", "h100",
                               "--json"], cwd=root)
    assert out.rc == 0, out.stderr
    p = json.loads(out.stdout)
    print(f"launch/pretrain_moe.sh {precision}: {p['memory_gib']['total']:.2f} GiB of {p['gpu_memory_gib']:.1f}, "
          f"{p['moe']['expert_parameters_on_rank']:,} expert parameters per rank, all-to-all "
          f"{p['moe']['all_to_all_bytes_per_step'] / 1e9:.2f} GB/step/rank ({p['cost_model']['ep_comm_s']:.2f} s)")
    assert p["fits"] and p["moe"]["experts_per_rank"] == 16 and p["moe"]["expert_data_parallel"] == 1
    assert p["cost_model"]["ep_comm_s"] == pytest.approx(p["moe"]["all_to_all_bytes_per_step"] / (450e9 * A2A))
