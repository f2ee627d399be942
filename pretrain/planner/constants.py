"""The cost model's constants: one table, each number with its unit and its source.

Sources are of three kinds: a vendor datasheet (a hardware figure: `pretrain.planner.hardware`, the peaks in
`pretrain.observe.flops`), a published microbenchmark or a count (what a kernel or a collective reaches, what a
module launches), or "calibrated": chosen on the calibration rows of Megatron-Bridge's published pre-training table
(`benchmarks/megatron_bridge_pretraining.tsv`, the rows of supported models whose 0-based index is not 4 mod 5: a rule
fixed before any number was chosen; `pretrain.planner.published_table.held_out`), by a coordinate search minimising the
squared log ratio of predicted to published tokens/s/GPU (each row's term capped at log(1.35)²), within the range
the source gives where one does. The held-out rows (index 4 mod 5) were never used to choose a number; their
residuals per GPU kind are in `docs/performance.md`, which prints the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.planner.hardware import GPUS


@dataclass(frozen=True)
class Constant:
    value: float
    unit: str
    source: str


def _gpu(values: dict[str, float], unit: str, source: str) -> dict[str, Constant]:
    return {gpu: Constant(v, unit, source) for gpu, v in values.items()}


# Per-GPU hardware figures: `pretrain.planner.hardware` (memory, HBM, links, NVLink domain; each with its datasheet);
# peak TFLOP/s per precision: `pretrain.observe.flops.PEAK_TFLOPS`. HBM_TBPS (below the table) is the HBM view the
# memory-bound terms read: the datasheet bandwidth times `hbm_efficiency`.

# Fused (flash / cuDNN) attention, forward + backward, of the bf16 peak (it stays bf16 under FP8 recipes).
_ATTENTION = ("published FlashAttention-3 / cuDNN SDPA: H100 ~600 fwd / ~450 bwd TFLOP/s of 989; B200 cuDNN ~1,000 "
              "fwd / ~650 bwd of 2,250; Blackwell Ultra (B300, GB300) doubles the softmax's exponentials; A100 FA2 "
              "~170 of 312; calibrated on the published table (H100 below the range: what the kernels reach at the "
              "table's sequences, head dims and masks; H100 0.31 -> 0.33 with kernel_gpu_us)")
ATTENTION_EFFICIENCY = _gpu({"h100": 0.33, "h200": 0.33, "b200": 0.40, "gb200": 0.40, "b300": 0.48, "gb300": 0.48,
                             "a100": 0.55}, "of bf16 peak, fwd+bwd", _ATTENTION)

# The fraction of the datasheet's (boost-clock) peak a GPU sustains under a training load, relative to the H100 the
# GEMM efficiencies below were measured on: power and clocks (H100 SXM 700 W, B200 1,000 W, GB200 1,200 W, B300
# 1,100 W, GB300 1,400 W per GPU). Calibrated per GPU kind on the calibration rows of the published table.
SUSTAINED = _gpu({"h100": 1.0, "h200": 1.0, "a100": 1.0, "b200": 0.81, "b300": 0.89, "gb200": 0.85, "gb300": 1.0},
                 "of the datasheet peak",
                 "power-limited clocks; calibrated per GPU kind on the published table (docs/performance.md; with "
                 "kernel_gpu_us: B200 0.77 -> 0.81, B300 0.85 -> 0.89)")

CONSTANTS: dict[str, Constant] = {
    # GEMMs: the fraction of the dense peak a large, well-shaped GEMM reaches (cuBLAS/cuBLASLt).
    "gemm_efficiency_bf16": Constant(
        0.735, "of bf16 peak",
        "published cuBLAS microbenchmarks: ~700-750 TFLOP/s of 989 on H100 SXM for 8k-square bf16 GEMMs; calibrated "
        "in that range (0.70 before kernel_gpu_us)"),
    "gemm_efficiency_fp8": Constant(
        0.58, "of fp8 peak",
        "published cuBLASLt FP8 microbenchmarks: ~1,200-1,400 TFLOP/s of 1,979 on H100; calibrated near that range"),
    "gemm_efficiency_mxfp8": Constant(
        0.62, "of fp8 peak", "B200 MXFP8 cuBLASLt ~2.8-3.2 PFLOP/s of 4.5; calibrated at that range's low end "
        "(0.64 before: the calibration loss 2.043 -> 2.015 at 0.62, 2.017 at 0.60)"),
    "gemm_efficiency_nvfp4": Constant(
        0.55, "of nvfp4 peak",
        "no published NVFP4 training-GEMM microbenchmark in hand: calibrated (0.50 before: the calibration loss 2.043 "
        "-> 2.018 at 0.55, 2.022 at 0.58, 2.127 at 0.45), bounded above by the MXFP8 fraction (0.62): NVFP4 GEMMs "
        "carry 16-element block scales and Transformer Engine's NVFP4 recipe a 2D-scaled weight"),
    "grouped_gemm_efficiency": Constant(
        0.57, "of the GEMM efficiency at the same shape",
        "TE/cuBLASLt grouped GEMM vs one GEMM of the same total size (published TE MoE benchmarks 0.7-0.9); "
        "calibrated below that on the published table's MoE rows (it also carries what the MoE layer's GEMMs lose "
        "to routing, padding and the dispatcher's waits)"),
    # FP8: the casts Transformer Engine adds around every FP8 GEMM, memory-bound (bytes moved per element).
    "fp8_cast_bytes_per_element": Constant(
        4.0, "bytes per input/grad element",
        "read bf16 (2) + write the FP8 row-wise and column-wise copies (1 + 1): TE's cast-transpose kernels"),
    "fp4_cast_bytes_per_element": Constant(
        9.4, "bytes per input/grad element",
        "counted: read bf16 (2) + write the NVFP4 row-wise and column-wise copies with their 16-element scales (0.5 + "
        "0.5 + 1/16) + the weight-gradient inputs' random Hadamard transform (Transformer Engine's NVFP4 recipe: read "
        "2) ~5; calibrated at 9.4 on the NVFP4 rows (the amax reductions and scale computations of 2D block scaling)"),
    # Attention: fused (flash / cuDNN) attention runs in bf16 also under FP8 recipes (no FP8 attention).
    "gemm_half_efficiency_dim": Constant(
        128.0, "elements: the narrowest GEMM dimension d at which efficiency halves, factor d / (d + this)",
        "cuBLAS tile widths 128-256: a GEMM narrower than a tile wastes the rest; calibrated"),
    "attention_half_efficiency_head_dim": Constant(
        96.0, "head dim d at which fused attention's efficiency halves, factor d / (d + this), 1 at d = 128",
        "FlashAttention-3 (Shah et al. 2024, H100 bf16): head dim 64 reaches ~0.7 of head dim 128's TFLOP/s"),
    "attention_sinks_efficiency": Constant(
        0.23, "of the attention efficiency, with learnable softmax sinks (model.softmax_type)",
        "Transformer Engine runs sink attention through cuDNN's sink kernels (cuDNN 9.13+), not FlashAttention; no "
        "published benchmark of them in hand: calibrated on the rows with sinks (GPT-OSS's), so it also carries "
        "whatever else makes GPT-OSS slower than its shapes predict (not identified)"),
    "attention_tile": Constant(
        128.0, "keys per tile of fused attention",
        "flash / cuDNN attention compute whole 128-key tiles: a causal query tile computes its diagonal tile whole "
        "(+T/2 keys per query), a window of W keys touches W + T keys"),
    "attention_backward_ratio": Constant(
        2.5, "bwd FLOPs / fwd FLOPs", "flash attention's backward recomputes the scores: 5 GEMMs vs 2"),
    # Memory-bound kernels: what they reach of the datasheet HBM bandwidth (every term that moves bytes reads it).
    "hbm_efficiency": Constant(
        0.75, "of the datasheet HBM bandwidth",
        "published copy / STREAM-triad kernels: ~3.0-3.1 of 3.35 TB/s on H100 SXM (~0.9); calibrated below that on "
        "the published table (a training step's memory-bound kernels are many and mid-sized: launch tails, partial "
        "waves, unaligned rows)"),
    # Memory-bound work per decoder layer (norms, residual adds, RoPE, SwiGLU, their backward).
    "elementwise_passes": Constant(
        36.0, "h-wide activation reads+writes per token per layer, fwd+bwd",
        "counted from the kernels' reads and writes: 2 RMSNorms (~8 h-passes fwd+bwd), 2 residual adds (~6), RoPE "
        "(~4), SwiGLU on 3·f ≈ 10 h (~15), bias/dropout fusions (~3): ~36"),
    "moe_act_passes": Constant(
        8.0, "f-wide reads+writes per routed token copy, fwd+bwd, fused SwiGLU of the experts",
        "Megatron-Core's fused bias-SwiGLU: forward reads 2f writes f, backward reads 3f writes 2f"),
    "moe_act_passes_unfused": Constant(
        42.0, "f-wide reads+writes per routed token copy, fwd+bwd, an unfused GLU (clamped, or not SiLU)",
        "GPT-OSS's clamped quick-GELU GLU in eager PyTorch: clamp, clamp, sigmoid, multiply, add, multiply (~14 "
        "f-passes forward), about twice that backward"),
    "moe_permute_passes": Constant(
        8.0, "h-wide reads+writes per routed token copy, fwd+bwd",
        "permute + unpermute (each a read and a write) in forward and backward"),
    # Host: kernel launches, when the GPU work per kernel is small the CPU bounds the step (no CUDA graphs).
    "kernels_per_dense_layer": Constant(
        90.0, "kernels fwd+bwd", "counted in nsys traces of a TE layer: ~30 fwd, ~60 bwd"),
    "kernels_per_moe_layer": Constant(
        133.0, "kernels fwd+bwd, router + dispatcher + grouped GEMM",
        "as above with router, permute, a2a, grouped GEMM"),
    "kernels_per_local_expert": Constant(
        13.0, "kernels fwd+bwd per expert on the rank, per MoE layer",
        "Transformer Engine's grouped linear launches a GEMM per expert (fc1, fc2; their data and weight gradients) "
        "and its casts; calibrated"),
    "launch_us": Constant(
        28.0, "µs of host time per kernel (eager PyTorch + TE + Megatron)",
        "published PyTorch eager per-op overhead 5-20 µs; calibrated above it on the published table's "
        "small-microbatch MoE rows: it also carries Megatron's Python per module (routing bookkeeping, the "
        "dispatcher's host syncs)"),
    "kernel_gpu_us": Constant(
        3.0, "µs of GPU time per kernel beside its work, CUDA graph or not",
        "a kernel's fixed cost on the GPU beyond the roofline of its FLOPs and bytes: the gap to the kernel before "
        "it (about a microsecond back to back in a stream or a graph: NVIDIA's 'Getting Started with CUDA Graphs'), "
        "its first memory accesses' latency, its ramp and its last partial wave; not measured here: the middle of "
        "1-5 µs, kept by the calibration loss (docs/performance.md: 1.903 -> 1.774 with the moves it brought)"),
    "launch_us_cuda_graphs": Constant(1.5, "µs per kernel under CUDA graphs", "graph replay ~1-2 µs per node"),
    # What a CUDA graph scope captures (performance.cuda_graph_scope; local impl without a scope: every layer).
    "kernels_attention": Constant(
        40.0, "kernels fwd+bwd of a layer's attention block (scope attn)",
        "Megatron-Core's self-attention under TE: input norm + QKV GEMM, RoPE, fused attention, projection, residual "
        "(~12 fwd), about twice that in backward; of kernels_per_dense_layer"),
    "kernels_moe_router": Constant(
        16.0, "kernels fwd+bwd (scope moe_router)",
        "router GEMM, score function, top-k, expert bias / aux loss (~6 fwd), their backward"),
    "kernels_moe_preprocess": Constant(
        16.0, "kernels fwd+bwd (scope moe_preprocess)",
        "the dispatcher's preprocessing: routing map, token counts per expert, permutation indices (~8 fwd + bwd)"),
    # Communication kernels that share the GPU with compute while the EP all-to-all is overlapped.
    "deepep_sms": Constant(20.0, "SMs", "DeepEP's Buffer.num_sms default; Megatron-Core moe_deepep_num_sms = 20"),
    "hybridep_sms": Constant(
        32.0, "SMs", "Megatron-Bridge's performance scripts set moe_hybridep_num_sms = 32 (Megatron-Core default 24)"),
    "nccl_a2a_sms": Constant(
        32.0, "SMs", "NCCL all-to-all over send/receive: one thread block per channel, up to 32 channels"),
    # Collectives: achieved / link bandwidth (one direction). NVLINK_GBPS, NETWORK_GBPS: planner.common.
    "nvlink_collective_efficiency": Constant(
        0.80, "of NVLink bandwidth", "nccl-tests all-gather/reduce-scatter bus bandwidth ~360 GB/s of 450 on H100"),
    "nvlink_a2a_efficiency": Constant(
        0.60, "of NVLink bandwidth",
        "published all-to-all microbenchmarks (NCCL alltoall, DeepEP intranode) 0.4-0.9 of the link; calibrated"),
    "network_efficiency": Constant(
        0.73, "of NIC bandwidth",
        "DeepEP internode RDMA ~43-47 GB/s per 400 Gb/s NIC, nccl-tests ~45 GB/s (0.9); calibrated below that on the "
        "published table's multi-node rows (all-to-alls between many peers)"),
    "tp_overlap_exposed": Constant(
        0.23, "of TP communication left exposed with parallel.tp_comm_overlap",
        "TE userbuffers hide the all-gather/reduce-scatter behind the GEMM chunks; calibrated"),
    "p2p_exposed": Constant(
        0.0, "of pipeline send/receive exposed with interleaving", "Megatron overlaps P2P with VP (overlap_p2p_comm)"),
    # Mamba-2 layers (hybrid models, `pretrain.planner.mamba`): their GEMMs (in/out projections) are costed as every
    # GEMM, the SSD scan as fused attention over 2K tokens (`mamba.SSD_ATTENTION_EQUIVALENT_TOKENS`, a measurement);
    "mamba_passes": Constant(
        7.0, "reads+writes of the in-projection's output width W per token, fwd+bwd, beside the scan",
        "counted from Megatron-Core's GPU path (mamba_split_conv1d_scan_combined, RMSNormGated): forward, the causal "
        "convolution reads and writes x, B, C (~0.6 W each way), the gated norm reads y and z and writes its output "
        "(~1.2 W): ~2.4 W; backward recomputes the convolution and moves about twice that"),
    "kernels_mamba": Constant(
        36.0, "kernels fwd+bwd of a Mamba-2 layer (scope mamba)",
        "counted: norm, in_proj GEMM, the combined conv + scan (conv1d, chunk cumsum, chunk state, state passing, "
        "bmm chunk, chunk scan), gated norm, out_proj, residual: ~12 forward, ~2x that backward"),
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


HBM_TBPS = {name: Constant(g.hbm_tbps * CONSTANTS["hbm_efficiency"].value, "TB/s reached",
                          f"{g.source}; times hbm_efficiency") for name, g in GPUS.items()}


def value(name: str) -> float:
    """A constant's value."""
    return CONSTANTS[name].value


def table() -> list[tuple[str, float, str, str]]:
    """(name, value, unit, source) of every number the cost model uses: the GPU figures (peaks, memory, HBM, links)
    first."""
    from pretrain.observe.flops import PEAK_TFLOPS
    from pretrain.planner.hardware import table as hardware_table

    rows = [(f"peak_tflops[{g}][{k}]", v, "TFLOP/s dense", "vendor datasheets (pretrain/observe/flops.py)")
            for g, peaks in PEAK_TFLOPS.items() for k, v in peaks.items()]
    rows += hardware_table()
    rows += [(f"attention_efficiency[{g}]", c.value, c.unit, c.source) for g, c in ATTENTION_EFFICIENCY.items()]
    rows += [(f"sustained[{g}]", c.value, c.unit, c.source) for g, c in SUSTAINED.items()]
    return rows + [(k, c.value, c.unit, c.source) for k, c in CONSTANTS.items()]
