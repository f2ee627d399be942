"""The planner's terms that depend on what Megatron-Core and Transformer Engine do on the GPU kind and with the run's
settings (issue 43, the published runs that ran): FP8 transposes on Blackwell, layer-wise activation offloading, the
expert weights' data-parallel collectives, and a hybrid (Mamba-2) model's step time. Expected values are hand counts
from the model's shapes, the sources' rules (named in each test) and Megatron-Bridge's published figures."""

from __future__ import annotations

import pytest

from pretrain.config import load_config
from pretrain.planner.common import GIB
from pretrain.planner.constants import value
from pretrain.planner.plan import make_plan
from pretrain.planner.published_table import Harness, plan_row, read_table

BASE = ["data.mock=true", "parallel.tensor=1", "parallel.pipeline=1", "train.micro_batch_size=1",
        "train.global_batch_size=64", "optimizer.distributed=true"]
# Llama-3-8B's GEMM weights: 32 layers of QKV (4096 × (4096 + 2 · 1024)), the projection (4096²), fc1 (4096 × 2 · 14336)
# and fc2 (14336 × 4096)
LINEAR = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 4096 * 2 * 14336 + 14336 * 4096)


def _fp8_gib(gpu: str, recipe: str, param_gather: bool) -> float:
    gather = f"model.fp8_param_gather={str(param_gather).lower()}"
    cfg = load_config("llama3_8b", [*BASE, f"model.fp8={recipe}", gather])
    return make_plan(cfg, 1, 8, gpu)["memory_gib"]["fp8"]


def test_fp8_copies_by_gpu_kind_and_recipe():
    """Transformer Engine keeps a per-tensor-scaled FP8 tensor's transpose only where FP8 GEMMs are TN-only (Hopper):
    on Blackwell `is_non_tn_fp8_gemm_supported` serves column-wise use from the row-wise data. MXFP8 keeps row-wise
    and column-wise data everywhere. One byte per GEMM weight element per copy beside the parameter."""
    one = round(LINEAR / GIB, 3)
    assert _fp8_gib("h100", "tensorwise", True) == pytest.approx(one, abs=0.01)  # the transpose of the FP8 parameter
    assert _fp8_gib("h100", "tensorwise", False) == pytest.approx(2 * one, abs=0.01)  # FP8 copy + its transpose
    assert _fp8_gib("b200", "tensorwise", True) == 0  # the FP8 parameter serves both uses
    assert _fp8_gib("b200", "tensorwise", False) == pytest.approx(one, abs=0.01)  # the FP8 copy only
    assert _fp8_gib("b200", "mxfp8", True) == pytest.approx(one, abs=0.01)  # MXFP8's column-wise data


def test_offloading_keeps_the_layers_not_offloaded():
    """Layer-wise activation offloading of N of L layers keeps (L − N) layers' activations on the GPU (Transformer
    Engine's DefaultOffloadSynchronizer: "peak memory usage of saving activations is (num_layers −
    num_offloaded_layers) · T"): offloading 16 layers frees 16 layers, 8 more free 8 more — twice as much."""
    def activations(n: int) -> float:
        extra = [f"performance.cpu_offloading_num_layers={n}"] if n else []
        return make_plan(load_config("llama3_8b", [*BASE, *extra]), 1, 8, "b200")["memory_gib"]["activations"]

    none, half, three_quarters = activations(0), activations(16), activations(24)
    assert (none - half) / (half - three_quarters) == pytest.approx(2.0, rel=1e-3)


def test_expert_weights_reduce_at_the_expert_data_parallel_groups_nics():
    """GPT-OSS-120B at EP8 on 8 DGX B200 nodes: the expert weights' gradient reduce-scatter and parameter all-gather run
    over expert data parallel (8 ranks, one per node: one NIC per node), the dense weights' over all 64 ranks (8 NICs
    per node); without overlap every byte is on the step."""
    overrides = ["data.mock=true", "parallel.pipeline=1", "parallel.expert=8", "parallel.expert_tensor=1",
                 "train.micro_batch_size=4", "train.global_batch_size=512", "optimizer.overlap_grad_reduce=false",
                 "optimizer.overlap_param_gather=false", "optimizer.grad_reduce_in_fp32=false"]
    plan = make_plan(load_config("gpt_oss_120b", overrides), 8, 8, "b200")
    params, expert = plan["most_loaded_rank"]["parameters"], plan["moe"]["expert_parameters_on_rank"]
    nic = 50e9 * value("network_efficiency")  # 400 Gb/s ConnectX-7 per GPU
    dense_bw = min(900e9 * value("nvlink_collective_efficiency"), 8 * nic)
    expected = 2 * 2 * (63 / 64 * (params - expert) / dense_bw + 7 / 8 * expert / nic)  # bf16, both collectives
    assert plan["cost_model"]["dp_comm_s"] == pytest.approx(expected, rel=1e-6)


def test_nemotron3_nano_costs_its_mamba_layers():
    """Megatron-Bridge's Nemotron 3 Nano run on 8 B200 (26.04.01, MXFP8, EP8, micro batch 2, HybridEP, CUDA graphs of
    attention, Mamba, router and preprocessing): 32,768 tokens/s/GPU at 726 TFLOP/s/GPU (2.2e10 FLOPs per token). The
    plan costs its 23 Mamba-2 layers as projections, scan and their memory-bound kernels and attention on its 6
    attention layers only (costed as 52 attention + MLP layers it was 0.57×)."""
    row = read_table()[37]
    assert (row.cells["model"], row.cells["system"], row.cells["container"]) == ("Nemotron_3_Nano", "b200", "26.04.01")
    p = plan_row(row, Harness.load())
    print(f"{p.name}: ×{p.ratio:.2f}, FLOPs ×{p.flops_ratio:.3f}, {p.memory_gib:.1f} GiB (margin {p.margin_gib:+.1f})")
    assert p.fits and abs(p.ratio - 1) <= 0.15 and abs(p.flops_ratio - 1) <= 0.03


def test_each_kernel_costs_the_gpu_its_fixed_time_graph_or_not():
    """`kernel_gpu_us`: every kernel holds the GPU a fixed time beside its work (its gap to the one before, ramp, last
    partial wave), whether the host launched it or a CUDA graph replayed it. A graph shrinks the host's launches, not
    that time; both terms count the same kernels, so in eager mode they stand in the ratio of their per-kernel costs;
    per microbatch, so twice the batch is twice the time."""
    def cost(*extra: str) -> dict:
        overrides = ["data.mock=true", "parallel.pipeline=1", "parallel.virtual_pipeline=null", "parallel.expert=8",
                     "train.micro_batch_size=1", *extra]
        return make_plan(load_config("qwen3_30b_a3b", overrides), 1, 8, "b200")["cost_model"]

    eager = cost("train.global_batch_size=64")
    graphed = cost("train.global_batch_size=64", "performance.cuda_graph_impl=local")
    double = cost("train.global_batch_size=128")
    assert eager["kernel_s"] > 0 and graphed["kernel_s"] == pytest.approx(eager["kernel_s"])
    assert graphed["host_s"] == pytest.approx(eager["host_s"] * value("launch_us_cuda_graphs") / value("launch_us"))
    assert eager["kernel_s"] / eager["host_s"] == pytest.approx(value("kernel_gpu_us") / value("launch_us"))
    assert double["kernel_s"] == pytest.approx(2 * eager["kernel_s"])
    assert graphed["compute_s"] < eager["compute_s"]  # eager, this layout is host-bound
