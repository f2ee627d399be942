"""Activation terms of DeepSeek-V3-class models: Multi-Latent Attention, DeepSeek routing (sigmoid scores, expert
groups), shared experts and Multi-Token Prediction — what autograd keeps per layer and microbatch.

Notation as in `activations`: s = sequence / CP, b = micro batch, t = TP, p = bytes per value; a heads, r_q / r_kv
the q / KV LoRA ranks, d_qk / d_pe / d_v the per-head widths (no-RoPE query/key, RoPE, value); T the tokens of this
rank's sequence slice. Measured on CPU ranks (local spec, fp32 and bf16, varied T, E, k, groups; see
tests/pretrain/test_plan.py); the Transformer Engine paths from their source.
"""

from __future__ import annotations

from collections.abc import Callable

from pretrain.config import Config
from pretrain.layout import Layout

NormTerms = Callable[[int, int], int]  # (values, rows) -> bytes a norm and the GEMM it feeds keep


def mla_terms(cfg: Config, lay: Layout, norm: NormTerms, recompute_core_attention: bool) -> dict[str, int]:
    """MLA's attention, after the input norm (counted with the norms): the latent norms, RoPE, Q/K/V, scores.

    Local spec: each latent norm (q: r_q wide, KV: r_kv) keeps what a norm keeps and its output is the
    up-projection's input. RoPE makes new query and key rope parts from de-interleaved copies and keeps cos and
    sin for both (4·s·d_pe·p). The query [T, a/t, d_qk + d_pe] and the key (the shared rope part expanded to every
    head) are new concatenations, the value a contiguous copy: attention keeps all three, and the local attention
    its causal mask and the fp32 scores (and their p-byte copy). In fp32 without sequence parallelism the KV norm's
    input is a view of the down-projection's whole output (r_kv + d_pe wide); in bf16 its fp32 copy is r_kv wide.
    With Transformer Engine the latent norms are fused into the up-projections (input, fp32 rstd, output) and its
    fused attention keeps Q, K, V and the softmax statistics.
    """
    m = cfg.model
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
    out["mla_latents"] = latent
    out["qkv"] = s * b * a * (2 * (qk + pe) + v) * p
    if lay.use_te and not recompute_core_attention:
        out["softmax_stats"] = 4 * b * a * s
    elif not lay.use_te:
        out["rope_cos_sin"] = 4 * s * pe * p
        if not recompute_core_attention:
            out["causal_mask"] = s * s
            out["scores"] = (4 + (p if p != 4 else 0)) * b * a * s * s
    return out


def sigmoid_router_terms(cfg: Config, lay: Layout, tokens: int) -> int:
    """Router and token dispatcher with sigmoid scores (DeepSeek), fp32: (9·E + 20·k + 4) bytes per token; expert
    groups add E + 8·G·(k / group_topk) + 8·group_topk (the group scores' top indices, the chosen groups, the
    expert mask); a load-balancing loss (4·E + 8·k + 4) per token + 8·E + 4. The expert bias and the scaling
    factor keep nothing more."""
    m = cfg.model
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


def shared_expert_terms(cfg: Config, lay: Layout, fused_swiglu: bool) -> int:
    """The shared experts, a dense MLP of width f_s split over TP (its input is the pre-MLP norm's output)."""
    m = cfg.model
    p = lay.bytes_per_value
    fs = m.moe_shared_expert_intermediate_size or 0
    sbf = (m.seq_length // lay.cp) * lay.mbs * fs // lay.tp
    fc2_in = 1 if (m.fp8 and lay.use_te) else p
    if not m.gated_linear_unit:
        return sbf * (p + fc2_in)
    return sbf * ((2 if fused_swiglu else 4) * p + fc2_in)


def mtp_extras(cfg: Config, lay: Layout, padded_vocab: int, norm: NormTerms) -> int:
    """What the MTP layers keep per microbatch besides their transformer layers: the shifted token ids, the
    embedding and hidden norms and the projection's input (their concatenation, 2h), the final norm and output
    GEMM input, and the loss (as the main loss: fp32 softmax over V/t, target mask and masked targets, the
    shifted loss mask, and the scaled loss the auto-scaler keeps)."""
    m = cfg.model
    p = lay.bytes_per_value
    s, b, t = m.seq_length // lay.cp, lay.mbs, lay.tp
    hs = s * b * m.hidden_size // (t if lay.sp else 1)
    rows = hs // m.hidden_size
    per_layer = 16 * s * b  # the shifted token ids (embedding lookup, roll)
    per_layer += 2 * (norm(hs, rows) - hs * p) + 2 * hs * p  # enorm, hnorm; eh_proj keeps [e; h]
    per_layer += norm(hs, rows)  # the final norm and the output GEMM's input
    per_layer += 4 * s * b * (padded_vocab // t) + 9 * s * b + 4 * s * b + 4 * s * b
    return (m.mtp_num_layers or 0) * per_layer
