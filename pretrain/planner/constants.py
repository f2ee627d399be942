"""The cost model's constants: one table, each number with its unit and its source.

Sources are of three kinds: a vendor datasheet (a hardware figure), a published microbenchmark (what a kernel or a
collective reaches on that hardware), or "calibrated": chosen within the range the microbenchmarks give so that the
six calibration runs of `benchmarks/published_runs.yaml` (Megatron-Bridge's performance summary, `calibration: true`)
are predicted within ±15%. No other run was used to choose a number. `docs/performance.md` prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    value: float
    unit: str
    source: str


def _gpu(values: dict[str, float], unit: str, source: str) -> dict[str, Constant]:
    return {gpu: Constant(v, unit, source) for gpu, v in values.items()}


# Per-GPU hardware figures (SXM parts). Peak TFLOP/s are pretrain.observe.flops.PEAK_TFLOPS (datasheets).
HBM_TBPS = _gpu({"h100": 3.35, "h200": 4.8, "b200": 8.0, "a100": 2.039}, "TB/s",
                "datasheets: H100 SXM 3.35, H200 4.8, B200 8, A100 80GB 2.039 TB/s")

# Fused (flash / cuDNN) attention, forward + backward, of the bf16 peak (it stays bf16 under FP8 recipes).
ATTENTION_EFFICIENCY = _gpu({"h100": 0.45, "h200": 0.45, "b200": 0.35, "a100": 0.55}, "of bf16 peak, fwd+bwd",
                            "published FlashAttention-3 / cuDNN SDPA: H100 ~600 fwd / ~450 bwd TFLOP/s of 989; "
                            "B200 cuDNN ~1,000 fwd / ~650 bwd of 2,250; A100 FA2 ~170 of 312; calibrated in range")

CONSTANTS: dict[str, Constant] = {
    # GEMMs: the fraction of the dense peak a large, well-shaped GEMM reaches (cuBLAS/cuBLASLt).
    "gemm_efficiency_bf16": Constant(
        0.72, "of bf16 peak",
        "published cuBLAS microbenchmarks: ~700-750 TFLOP/s of 989 on H100 SXM for 8k-square bf16 GEMMs"),
    "gemm_efficiency_fp8": Constant(
        0.62, "of fp8 peak",
        "published cuBLASLt FP8 microbenchmarks: ~1,200-1,400 TFLOP/s of 1,979 on H100; calibrated in that range"),
    "gemm_efficiency_mxfp8": Constant(
        0.62, "of fp8 peak", "as fp8 (B200 MXFP8 cuBLASLt ~2.8-3.2 PFLOP/s of 4.5); calibrated in that range"),
    "grouped_gemm_efficiency": Constant(
        0.80, "of the GEMM efficiency at the same shape",
        "TE/cuBLASLt grouped GEMM vs one GEMM of the same total size (published TE MoE benchmarks 0.7-0.9); "
        "calibrated"),
    # FP8: the casts Transformer Engine adds around every FP8 GEMM, memory-bound (bytes moved per element).
    "fp8_cast_bytes_per_element": Constant(
        4.0, "bytes per input/grad element",
        "read bf16 (2) + write the FP8 row-wise and column-wise copies (1 + 1): TE's cast-transpose kernels"),
    # Attention: fused (flash / cuDNN) attention runs in bf16 also under FP8 recipes (no FP8 attention).
    "gemm_half_efficiency_dim": Constant(
        128.0, "elements: the narrowest GEMM dimension d at which efficiency halves, factor d / (d + this)",
        "cuBLAS tile widths 128-256: a GEMM narrower than a tile wastes the rest; calibrated"),
    "attention_backward_ratio": Constant(
        2.5, "bwd FLOPs / fwd FLOPs", "flash attention's backward recomputes the scores: 5 GEMMs vs 2"),
    # Memory-bound work per decoder layer (norms, residual adds, RoPE, SwiGLU, their backward).
    "elementwise_passes": Constant(
        36.0, "h-wide activation reads+writes per token per layer, fwd+bwd",
        "counted from the kernels' reads and writes: 2 RMSNorms (~8 h-passes fwd+bwd), 2 residual adds (~6), RoPE "
        "(~4), SwiGLU on 3·f ≈ 10 h (~15), bias/dropout fusions (~3): ~36"),
    "moe_permute_passes": Constant(
        8.0, "h-wide reads+writes per routed token copy, fwd+bwd",
        "permute + unpermute (each a read and a write) in forward and backward"),
    # Host: kernel launches, when the GPU work per kernel is small the CPU bounds the step (no CUDA graphs).
    "kernels_per_dense_layer": Constant(
        90.0, "kernels fwd+bwd", "counted in nsys traces of a TE layer: ~30 fwd, ~60 bwd"),
    "kernels_per_moe_layer": Constant(
        150.0, "kernels fwd+bwd, router + dispatcher + grouped GEMM",
        "as above with router, permute, a2a, grouped GEMM"),
    "launch_us": Constant(
        12.0, "µs of host time per kernel (eager PyTorch + TE + Megatron)",
        "published PyTorch eager per-op overhead 5-20 µs; calibrated"),
    "launch_us_cuda_graphs": Constant(1.5, "µs per kernel under CUDA graphs", "graph replay ~1-2 µs per node"),
    # Collectives: achieved / link bandwidth (one direction). NVLINK_GBPS, NETWORK_GBPS: planner.common.
    "nvlink_collective_efficiency": Constant(
        0.80, "of NVLink bandwidth", "nccl-tests all-gather/reduce-scatter bus bandwidth ~360 GB/s of 450 on H100"),
    "nvlink_a2a_efficiency": Constant(
        0.45, "of NVLink bandwidth",
        "published all-to-all microbenchmarks (NCCL alltoall, DeepEP intranode) 0.4-0.9 of the link; calibrated"),
    "network_efficiency": Constant(
        0.90, "of NIC bandwidth", "DeepEP internode RDMA ~43-47 GB/s per 400 Gb/s NIC; nccl-tests ~45 GB/s"),
    "tp_overlap_exposed": Constant(
        0.25, "of TP communication left exposed with parallel.tp_comm_overlap",
        "TE userbuffers hide the all-gather/reduce-scatter behind the GEMM chunks; calibrated"),
    "p2p_exposed": Constant(
        0.0, "of pipeline send/receive exposed with interleaving", "Megatron overlaps P2P with VP (overlap_p2p_comm)"),
    # Selective recomputation: the forward of the recomputed modules again, as a share of a microbatch.
    "recompute_mlp_extra": Constant(
        0.15, "of a microbatch", "the MLP/MoE forward: ~⅓ (forward of fwd+bwd) × ~45% (its share of a layer's time)"),
    "recompute_core_attn_extra": Constant(
        0.05, "of a microbatch", "the core-attention forward: ~2/7 (fwd of fwd+bwd at 2.5×) × ~18% (its share)"),
    # Optimizer step: memory-bound over the elements this rank owns.
    "optimizer_bytes_per_element": Constant(
        36.0, "bytes per owned element",
        "fused Adam: fp32 main param, m, v read+write (24), fp32 grad read (4), bf16 param write (2), grad norm (4), "
        "zeroing (2)"),
}


def value(name: str) -> float:
    """A constant's value."""
    return CONSTANTS[name].value


def table() -> list[tuple[str, float, str, str]]:
    """(name, value, unit, source) of every number the cost model uses: the GPU figures (peaks, HBM, links) first."""
    from pretrain.observe.flops import PEAK_TFLOPS
    from pretrain.planner.common import NETWORK_GBPS, NVLINK_GBPS

    rows = [(f"peak_tflops[{g}][{k}]", v, "TFLOP/s dense", "vendor datasheets (pretrain/observe/flops.py)")
            for g, peaks in PEAK_TFLOPS.items() for k, v in peaks.items()]
    rows += [(f"nvlink[{g}]", v, "GB/s per GPU, one direction", "datasheets: NVLink 4 450, NVLink 5 900, A100 300")
             for g, v in NVLINK_GBPS.items()]
    rows += [(f"network[{g}]", v, "GB/s per GPU", "one 400 Gb/s (B200 table: 800 Gb/s) NIC per GPU (planner/common.py)")
             for g, v in NETWORK_GBPS.items()]
    rows += [(f"hbm_bandwidth[{g}]", c.value, c.unit, c.source) for g, c in HBM_TBPS.items()]
    rows += [(f"attention_efficiency[{g}]", c.value, c.unit, c.source) for g, c in ATTENTION_EFFICIENCY.items()]
    return rows + [(k, c.value, c.unit, c.source) for k, c in CONSTANTS.items()]
