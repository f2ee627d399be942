"""Activation terms of DeepSeek-V3-class models: Multi-Latent Attention, DeepSeek routing (sigmoid scores, expert
groups), shared experts and Multi-Token Prediction — what autograd keeps per layer and microbatch.

Notation as in `activations`: s = sequence / CP, b = micro batch, t = TP, p = bytes per value; a heads, r_q / r_kv
the q / KV LoRA ranks, d_qk / d_pe / d_v the per-head widths (no-RoPE query/key, RoPE, value); T the tokens of this
rank's sequence slice. Measured on CPU ranks (local spec, fp32 and bf16, varied T, E, k, groups; see
tests/pretrain/test_plan.py); the Transformer Engine paths from their source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretrain.config import ModelConfig, PerformanceConfig
from pretrain.layout import Layout
from pretrain.planner.precision import gemm_input_bytes

NormTerms = Callable[[int, int], int]  # (values, rows) -> bytes a norm and the GEMM it feeds keep


def mla_terms(m: ModelConfig, lay: Layout, norm: NormTerms, recompute_core_attention: bool,
              up_proj: bool = False) -> dict[str, int]:
    """MLA's attention, after the input norm (counted with the norms): the latent norms, RoPE, Q/K/V, scores.

    Local spec: each latent norm (q: r_q wide, KV: r_kv) keeps what a norm keeps and its output is the
    up-projection's input. RoPE makes new query and key rope parts from de-interleaved copies and keeps cos and
    sin for both (4·s·d_pe·p). The query [T, a/t, d_qk + d_pe] and the key (the shared rope part expanded to every
    head) are new concatenations, the value a contiguous copy: attention keeps all three, and the local attention
    its causal mask and the fp32 scores (and their p-byte copy). In fp32 without sequence parallelism the KV norm's
    input is a view of the down-projection's whole output (r_kv + d_pe wide); in bf16 its fp32 copy is r_kv wide.
    With Transformer Engine the latent norms are fused into the up-projections (input, fp32 rstd, output) and its
    fused attention keeps Q, K, V and the softmax statistics.

    `up_proj` (`model.recompute_modules: [mla_up_proj]`, Megatron-Core's `CheckpointWithoutOutput` around the
    up-projections and RoPE): Q, K, V and RoPE's cos/sin are freed after core attention's forward and rebuilt in
    backward; the checkpoint keeps its inputs, the q latent (r_q), the down-projection's KV output (r_kv + d_pe) and
    (local spec) the RoPE frequencies (measured on CPU: tests/pretrain/test_mla_recompute.py). With Transformer Engine
    the latent norms are inside the checkpoint (fused into the up-projections; from the source), so they keep
    nothing more; the local spec's separate latent norms keep what they kept.
    """
    p = lay.bytes_per_value
    s, b, t = m.seq_length // lay.cp, lay.mbs, lay.tp
    a = m.num_attention_heads // t
    qk, pe, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    rows = s * b // (t if lay.sp else 1)  # the latents are scattered back to the sequence slice with SP
    out: dict[str, int] = {}
    latent = 0
    if m.qk_layernorm:
        if m.q_lora_rank is not None:
            latent += norm(rows * m.q_lora_rank, rows)
        latent += norm(rows * m.kv_lora_rank, rows)
        if not lay.use_te and p == 4 and not lay.sp:  # the fp32 "copy" is the down-projection output itself
            latent += 4 * rows * pe
    if up_proj and lay.use_te:
        latent = rows * ((m.q_lora_rank or 0) + m.kv_lora_rank + pe) * p
    out["mla_latents"] = latent
    out["qkv"] = 0 if up_proj else s * b * a * (2 * (qk + pe) + v) * p
    if lay.use_te and not recompute_core_attention:
        out["softmax_stats"] = 4 * b * a * s
    elif not lay.use_te:
        # cos and sin for Q and K; with up_proj the checkpoint keeps only its input, the fp32 RoPE frequencies.
        out["rope_cos_sin"] = s * pe * 4 if up_proj else 4 * s * pe * p
        if not recompute_core_attention:
            out["causal_mask"] = s * s
            out["scores"] = (4 + (p if p != 4 else 0)) * b * a * s * s
    return out


def sigmoid_router_terms(m: ModelConfig, lay: Layout, tokens: int) -> int:
    """Router and token dispatcher with sigmoid scores (DeepSeek), fp32: (9·E + 20·k + 4) bytes per token; expert
    groups add E + 8·G·(k / group_topk) + 8·group_topk (the group scores' top indices, the chosen groups, the
    expert mask); a load-balancing loss (4·E + 8·k + 4) per token + 8·E + 4. The expert bias and the scaling
    factor keep nothing more."""
    experts, k = m.num_moe_experts, m.moe_router_topk
    per_token = 9 * experts + 20 * k + 4
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if groups and group_topk:
        per_token += experts + 8 * groups * (k // group_topk) + 8 * group_topk
    out = tokens * per_token
    if m.moe_aux_loss_coeff > 0 and m.moe_router_load_balancing_type != "none":
        out += tokens * (4 * experts + 8 * k + 4) + 8 * experts + 4
    if m.moe_z_loss_coeff:
        out += 4 * tokens * experts + 4 * tokens + 4
    return out


def shared_expert_terms(m: ModelConfig, perf: PerformanceConfig, lay: Layout, fused_swiglu: bool) -> int:
    """The shared experts, a dense MLP of width f_s split over TP (its input is the pre-MLP norm's output; `m`,
    `perf`: the model and performance sections)."""
    p = lay.bytes_per_value
    fs = m.moe_shared_expert_intermediate_size or 0
    sbf = (m.seq_length // lay.cp) * lay.mbs * fs // lay.tp
    fc2_in = gemm_input_bytes(m, perf, lay) or p
    if not m.gated_linear_unit:
        return int(sbf * (p + fc2_in))
    return int(sbf * ((2 if fused_swiglu else 4) * p + fc2_in))


def mtp_extras(m: ModelConfig, lay: Layout, padded_vocab: int, norm: NormTerms) -> int:
    """What the MTP layers keep per microbatch besides their transformer layers: the shifted token ids, the
    embedding and hidden norms and the projection's input (their concatenation, 2h), the final norm and output
    GEMM input, and the loss (as the main loss: fp32 softmax over V/t, target mask and masked targets, the
    shifted loss mask, and the scaled loss the auto-scaler keeps)."""
    p = lay.bytes_per_value
    s, b, t = m.seq_length // lay.cp, lay.mbs, lay.tp
    hs = s * b * m.hidden_size // (t if lay.sp else 1)
    rows = hs // m.hidden_size
    per_layer = 16 * s * b  # the shifted token ids (embedding lookup, roll)
    per_layer += 2 * (norm(hs, rows) - hs * p) + 2 * hs * p  # enorm, hnorm; eh_proj keeps [e; h]
    per_layer += norm(hs, rows)  # the final norm and the output GEMM's input
    per_layer += 4 * s * b * (padded_vocab // t) + 9 * s * b + 4 * s * b + 4 * s * b
    return (m.mtp_num_layers or 0) * per_layer


def _layer_macs(m: Any, moe: bool) -> tuple[float, float, float]:
    """(all, MLA up-projections, shared experts) multiply-adds per token of one decoder layer's forward."""
    h, a = m.hidden_size, m.num_attention_heads
    if m.multi_latent_attention:
        qk, pe, v, rq, rkv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.q_lora_rank, m.kv_lora_rank
        up = (rq * a * (qk + pe) if rq else 0) + rkv * a * (qk + v)
        attn = (h * rq if rq else h * a * (qk + pe)) + h * (rkv + pe) + up + a * v * h
        core = m.seq_length / 2 * a * (qk + pe + v)
    else:
        d = m.kv_channels or h // a
        g = m.num_query_groups or a
        up, attn, core = 0, h * (a + 2 * g) * d + a * d * h, m.seq_length / 2 * a * 2 * d
    glu = 3 if m.gated_linear_unit else 2
    shared = glu * h * (m.moe_shared_expert_intermediate_size or 0) if moe else 0
    ffn = (m.moe_router_topk * glu * h * (m.moe_ffn_hidden_size or m.ffn_hidden_size) + shared) if moe else \
        glu * h * (m.ffn_hidden_size or 4 * h)
    return attn + core + ffn, up, shared


def recompute_shares(m: ModelConfig, modules: frozenset[str]) -> float:
    """The forward of `mla_up_proj`, `shared_experts` and (on a model with experts) the dense layers' `mlp` again, as a
    share of a microbatch's forward and backward (3× the forward), from their multiply-adds averaged over the
    layers (Megatron-Core recomputes exactly these GEMMs in backward; no calibrated constant)."""
    from pretrain.planner.census import is_moe_layer
    total = extra = 0.0
    for i in range(m.num_layers):
        moe = is_moe_layer(m, i)
        macs, up, shared = _layer_macs(m, moe)
        total += 3 * macs
        extra += (up if "mla_up_proj" in modules else 0) + (shared if "shared_experts" in modules else 0)
        if "mlp" in modules and m.num_moe_experts and not moe:
            extra += (3 if m.gated_linear_unit else 2) * m.hidden_size * (m.ffn_hidden_size or 4 * m.hidden_size)
    return extra / total if total else 0.0
