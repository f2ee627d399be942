"""The planner's Mamba-2 terms (hybrid models, `model.hybrid_layer_pattern`): the mixer's parameters on one TP rank,
what a Mamba layer keeps for backward per microbatch, and its scan's state working set. FLOPs per token are
Megatron-LM's hybrid accounting (`model_providers.core.hybrid.flops_per_token`, also the trainer's MFU).

Activations are those of Megatron-Core's GPU path (`mamba_split_conv1d_scan_combined`, the memory-efficient
kernel, then the gated norm's `RMSNormGated` and `out_proj`), from the source (not measured): the layer's norm and
the in-projection's input (as any norm + column-parallel GEMM), the in-projection's output zxBCdt (2·d_inner +
2·G·N + H values per token, what the kernel saves to recompute the convolution and the scan), the scan's output
before the gate (d_inner), the norm's input (d_inner) and fp32 statistics (one per group), and the out-projection's
input (d_inner); all over TP (heads, groups) and, with sequence parallelism, the norm over TP by tokens. The scan
keeps no state for backward; while it runs it holds one state per chunk, (s/Q)·H·P·N fp32 values (`scan_states`).
The CPU path (`model_providers/core/mamba_mixer.py`, autograd) keeps more: its intra-chunk decay and score
matrices, Q² per chunk and head.
"""

from __future__ import annotations

from typing import Any

from model_providers.core import hybrid
from pretrain.layout import Layout

FLOPS_FORMULA = ("F/token = 3·[Σ over layers: Mamba 2h(2d_in + 2GN + H) + 7·d_in·N + 2·d_in·h (d_in = 2h); "
                 "attention 4h(a·d/h)(h + h·g/a + s/2); MLP 4h·f; MoE 4h(k·f_e + f_s) (× 3/2 gated) + logits 2h·V; "
                 "each MTP depth: its layers + logits 2h·V] "
                 "(Megatron-LM's hybrid accounting, as Megatron-Bridge's published TFLOP/s)")


def mixer_parameters(m: Any, lay: Layout, pre: str) -> list[tuple[str, int, bool]]:
    """(name, elements on one TP rank, a GEMM weight) of a Mamba layer's mixer, in Megatron-Core's registration
    order (0.16.1: its own vectors, then in_proj, conv1d, the gated norm, out_proj)."""
    tp, h = lay.tp, m.hidden_size
    heads, inner = hybrid.mamba_num_heads(m), hybrid.mamba_inner(m)
    rows, conv = sum(hybrid.in_proj_parts(m).values()), sum(hybrid.conv_parts(m).values())
    x = f"{pre}.mixer"
    return [(f"{x}.dt_bias", heads // tp, False), (f"{x}.A_log", heads // tp, False), (f"{x}.D", heads // tp, False),
            (f"{x}.in_proj.weight", rows // tp * h, True), (f"{x}.conv1d.weight", conv // tp * m.mamba_conv_kernel,
                                                            False),
            (f"{x}.conv1d.bias", conv // tp, False), (f"{x}.norm.weight", inner // tp, False),
            (f"{x}.out_proj.weight", h * inner // tp, True)]


def mamba_layer_terms(m: Any, lay: Layout, norm_and_gemm_input: int) -> dict[str, int]:
    """Bytes one Mamba layer keeps for one microbatch (module docstring), by term; `norm_and_gemm_input`: the
    layer's norm and the in-projection's input (the planner's norm term)."""
    p = lay.bytes_per_value
    s, b, tp = m.seq_length // lay.cp, lay.mbs, lay.tp
    tokens = s * b
    inner = hybrid.mamba_inner(m) // tp
    rows = sum(hybrid.in_proj_parts(m).values()) // tp
    return {"norms_and_gemm_inputs": norm_and_gemm_input, "mamba_in_proj_out": tokens * rows * p,
            "mamba_scan_out": tokens * inner * p, "mamba_gated_norm": tokens * inner * p
            + tokens * max(m.mamba_num_groups // tp, 1) * 4, "mamba_out_proj_in": tokens * inner * p}


def scan_states(m: Any, lay: Layout) -> int:
    """fp32 bytes of the chunk states one Mamba layer's scan holds while it runs (per microbatch, this rank)."""
    s, b = m.seq_length // lay.cp, lay.mbs
    heads = hybrid.mamba_num_heads(m) // lay.tp
    return 4 * b * -(-s // m.mamba_chunk_size) * heads * m.mamba_head_dim * m.mamba_state_dim


def stage_layers(mp: Any, lay: Layout, offset: int, per_chunk: int, modules, layer_terms, norm_terms,
                 mtp: bool = False) -> list[int]:
    """Bytes each layer of a hybrid model's chunk keeps per microbatch, by its pattern symbol (`mtp`: the chunk
    holding the MTP depths, whose layers follow, `model.mtp_layer_pattern` × `model.mtp_num_layers`): a Mamba layer
    (`mamba_layer_terms`), or the attention / MLP / MoE half of a decoder layer (`layer_terms` of the activations
    model: the attention's terms and one norm; the MLP's or the experts' terms and one norm). `layer_terms`,
    `norm_terms`: `pretrain.planner.activations`' functions (passed in: that module calls this one); `mp`: the
    model's `ModelPlan` (what `layer_terms` reads)."""
    import dataclasses

    m = mp.config
    s, b, tp = m.seq_length // lay.cp, lay.mbs, lay.tp
    hs = s * b * m.hidden_size // (tp if lay.sp else 1)
    fp8 = bool(m.fp8) and lay.use_te
    dense_plan = dataclasses.replace(mp, config=dataclasses.replace(m, num_moe_experts=None))
    dense = layer_terms(dense_plan, lay, modules=modules)
    moe = layer_terms(mp, lay, modules=modules) if m.num_moe_experts else dense
    norm = dense["norms_and_gemm_inputs"] // 2
    ffn_keys = ("mlp", "moe_router", "moe_experts", "moe_shared_experts")
    attention = sum(v for k, v in dense.items() if k not in ffn_keys) - norm
    mlp = dense.get("mlp", 0) + norm
    experts = sum(moe.get(k, 0) for k in ffn_keys[1:]) + norm
    mamba = sum(mamba_layer_terms(m, lay, norm_terms(m, lay, hs, hs // m.hidden_size, fp8)).values())
    by_kind = {hybrid.MAMBA: mamba, hybrid.ATTENTION: attention, hybrid.MLP: mlp, hybrid.MOE: experts}
    kinds = m.hybrid_layer_pattern[offset:offset + per_chunk] + (hybrid.mtp_pattern(m) * (m.mtp_num_layers or 0)
                                                                 if mtp else "")
    return [by_kind[c] for c in kinds]


# The SSD scan's time: Dao & Gu 2024 ("Transformers are SSMs", §9.3 and its efficiency figure) measure the SSD kernel
# as fast as FlashAttention-2 at 2K tokens and faster beyond (linear against quadratic). The planner costs one Mamba
# layer's scan as the fused causal attention of its heads and head dim over a 2,048-token context, whatever the sequence
# (`timing.rank_work`): an upper bound past 2K, from a measurement rather than the kernel's FLOPs.
SSD_ATTENTION_EQUIVALENT_TOKENS = 2048


def mixer_bytes(m: Any, lay: Layout) -> float:
    """HBM bytes one Mamba layer's memory-bound kernels beside the scan move per microbatch on this rank (forward +
    backward), in units of the in-projection's output width W = 2·d_in + 2·G·N + H per token (`mamba_passes`, counted
    from Megatron-Core's GPU path: the causal convolution, the gated RMSNorm)."""
    from pretrain.planner.constants import value

    width = sum(hybrid.in_proj_parts(m).values()) / lay.tp
    return value("mamba_passes") * width * m.seq_length * lay.mbs / lay.cp * lay.bytes_per_value
