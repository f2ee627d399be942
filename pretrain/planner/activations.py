"""Activations: what autograd keeps per layer and per microbatch, and how many microbatches a pipeline
stage holds at its peak."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pretrain.config import Config
from pretrain.planner.common import Layout


def _qkv_saved_units(a: int, g: int, rope: bool, expanded: bool) -> int:
    """Q, K, V kept for attention's backward, in units of s·b·d/t values.

    Local attention expands K and V to all heads (GQA) and keeps the expanded copies. Flash attention
    and the selective-recompute checkpoint keep Q, K and V as given: RoPE makes new Q and K; V is a view
    of the fused QKV output, which therefore stays alive whole (a + 2g).
    """
    if expanded and g < a:
        return 3 * a
    mixed = a + 2 * g
    if rope:
        return a + g + mixed
    return mixed + (a if g < a else 0)  # GQA: reshaping Q out of the grouped layout copies it


def layer_activation_bytes(cfg: Config, lay: Layout, recompute_core_attention: bool = False) -> int:
    """Bytes autograd keeps for one decoder layer and one microbatch (no full recompute).

    Per layer (s = sequence / CP, b = microbatch, t = TP, p = bytes per value, Hs = s·b·h, divided by t
    with sequence parallelism): the two norms' inputs and the two column-parallel GEMMs' inputs (4·Hs·p);
    Q/K/V (`_qkv_saved_units`); the attention output that feeds the output projection (s·b·a·d/t·p); local
    attention's probabilities (fp32 softmax output plus its p-byte copy: (4 + p)·b·a·s²/t, or 4·b·a·s²/t
    in fp32) or flash attention's fp32 log-sum-exp (4·s·b·a/t); the MLP: fc1 output, activation output
    and fc2 input (SwiGLU: 4·s·b·f/t·p; GELU: 2·s·b·f/t·p). With FP8 (TE) the four GEMM inputs are kept as
    1-byte copies instead (the attention output also stays in p bytes for flash attention's backward).
    """
    m = cfg.model
    p = lay.bytes_per_value
    h, a = m.hidden_size, m.num_attention_heads
    g = m.num_query_groups or a
    d = m.kv_channels or h // a
    f = m.ffn_hidden_size or 4 * h
    s, b, t = m.seq_length // lay.cp, lay.mbs, lay.tp
    hs = s * b * h // (t if lay.sp else 1)
    rope = m.position_embedding_type == "rope"
    flash = lay.use_te
    keeps_scores = not flash and not recompute_core_attention
    qkv = _qkv_saved_units(a, g, rope, expanded=keeps_scores) * s * b * d // t * p
    attn_out = s * b * a * d // t * p
    if keeps_scores:
        scores = (4 + (p if p != 4 else 0)) * b * (a // t) * s * s
    elif flash and not recompute_core_attention:
        scores = 4 * s * b * (a // t)
    else:
        scores = 0
    if m.fp8 and lay.use_te:
        # Transformer Engine keeps the GEMM inputs (QKV, fc1, output projection, fc2) as FP8 copies.
        gemm_in = 2 * hs + s * b * a * d // t + s * b * f // t
        mlp = (3 if m.gated_linear_unit else 1) * s * b * f // t * p
        return 2 * hs * p + qkv + attn_out + scores + mlp + gemm_in
    mlp = (4 if m.gated_linear_unit else 2) * s * b * f // t * p
    return 4 * hs * p + qkv + attn_out + scores + mlp


def in_flight(lay: Layout, pp_rank: int) -> dict[int, int]:
    """Microbatches each model chunk of this stage holds activations for at the 1F1B peak."""
    m_total = lay.num_microbatches
    if lay.pp == 1:
        return {0: 1}
    if lay.vp == 1:
        return {0: min(lay.pp - pp_rank, m_total)}
    total = m_total * lay.vp
    warmup = min((lay.pp - pp_rank - 1) * 2 + (lay.vp - 1) * lay.pp, total)
    counts: dict[int, int] = {}
    for k in range(min(warmup + 1, total)):
        chunk = (k // lay.pp) % lay.vp
        counts[chunk] = counts.get(chunk, 0) + 1
    return counts


@dataclass
class ActivationMemory:
    saved: int  # activations held at the peak
    transient: int  # working buffers at the peak
    in_flight: dict[int, int] = field(default_factory=dict)


def activation_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int) -> ActivationMemory:
    """Activations this pipeline stage holds at its peak, and the transient buffers then."""
    m = cfg.model
    p = lay.bytes_per_value
    h = m.hidden_size
    s, b, t = m.seq_length // lay.cp, lay.mbs, lay.tp
    hs = s * b * h // (t if lay.sp else 1)
    per_chunk = m.num_layers // (lay.pp * lay.vp)
    selective = m.recompute_granularity == "selective"
    full_layer = layer_activation_bytes(cfg, lay, recompute_core_attention=selective)
    stored_layers, working = full_layer * per_chunk, 0
    if m.recompute_granularity == "full":
        n = max(1, m.recompute_num_layers or 1)
        if m.recompute_method == "block":
            k = min(n, per_chunk)
            stored_layers = k * hs * p + (per_chunk - k) * full_layer
            working = full_layer if k else 0
        else:
            stored_layers = math.ceil(per_chunk / n) * hs * p
            working = min(n, per_chunk) * full_layer
    vocab_shard = padded_vocab // t
    flights = in_flight(lay, pp_rank)
    saved = 0
    for chunk, count in flights.items():
        per_mb = stored_layers
        if pp_rank == 0 and chunk == 0:
            per_mb += 8 * s * b * (2 if m.position_embedding_type == "learned_absolute" else 1)  # token ids
        if pp_rank == lay.pp - 1 and chunk == lay.vp - 1:
            # final norm input, output-layer input, fp32 softmax kept by the vocab-parallel cross entropy
            per_mb += 2 * hs * p + 4 * s * b * vocab_shard + 9 * s * b
        saved += count * per_mb
    transient = working + 2 * hs * p  # pipeline send/receive (or the stage input/output)
    gather = s * b * h * p if lay.sp else 0  # sequence-parallel all-gather buffer
    if not lay.use_te and selective is False:
        gather = max(gather, b * (m.num_attention_heads // t) * s * s * p)  # shared with the score buffer
    transient += gather
    if pp_rank == lay.pp - 1:
        transient += s * b * vocab_shard * p  # the logits themselves, alive through the loss
    return ActivationMemory(saved=saved, transient=transient, in_flight=flights)
