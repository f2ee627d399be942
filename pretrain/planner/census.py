"""Parameter census: every parameter of one rank's model chunks, named and sized as Megatron-Core's local
spec registers them (the Transformer Engine spec holds the same elements)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pretrain.config import Config
from pretrain.layout import Layout, expert_tensor_size
from pretrain.planner.common import layout_of


@dataclass
class Param:
    name: str
    numel: int
    linear: bool = False  # a transformer-layer GEMM weight (FP8-cast by Transformer Engine)
    shared_embedding: bool = False  # Megatron puts it in its own bucket with the distributed optimizer
    expert: bool = False  # an MoE expert's weight: its own DDP buffer, sharded over expert data parallel


def _norm_params(prefix: str, m: Any) -> list[Param]:
    out = [Param(f"{prefix}.weight", m.hidden_size)]
    if m.normalization == "LayerNorm":
        out.append(Param(f"{prefix}.bias", m.hidden_size))
    return out


def layer_parameters(m: Any, lay: Layout, index: int) -> list[Param]:
    """One decoder layer's parameters on one TP rank, in Megatron's local-spec registration order."""
    h, a, tp = m.hidden_size, m.num_attention_heads, lay.tp
    g, d, f = lay.num_query_groups, lay.head_dim, lay.ffn_hidden_size
    pre = f"decoder.layers.{index}"
    out = _norm_params(f"{pre}.input_layernorm", m)
    out.append(Param(f"{pre}.self_attention.linear_proj.weight", h * a * d // tp, linear=True))
    if m.add_bias_linear:
        out.append(Param(f"{pre}.self_attention.linear_proj.bias", h))
    qkv = (a + 2 * g) * d // tp
    out.append(Param(f"{pre}.self_attention.linear_qkv.weight", qkv * h, linear=True))
    if m.add_bias_linear or m.add_qkv_bias:
        out.append(Param(f"{pre}.self_attention.linear_qkv.bias", qkv))
    if m.qk_layernorm:  # per-head norms of queries and keys, replicated across TP
        out += [Param(f"{pre}.self_attention.{n}_layernorm.weight", d) for n in ("q", "k")]
    out += _norm_params(f"{pre}.pre_mlp_layernorm", m)
    if m.num_moe_experts:
        return out + moe_parameters(m, lay, pre)
    fc1 = (2 if m.gated_linear_unit else 1) * f // tp
    out.append(Param(f"{pre}.mlp.linear_fc1.weight", fc1 * h, linear=True))
    if m.add_bias_linear:
        out.append(Param(f"{pre}.mlp.linear_fc1.bias", fc1))
    out.append(Param(f"{pre}.mlp.linear_fc2.weight", h * f // tp, linear=True))
    if m.add_bias_linear:
        out.append(Param(f"{pre}.mlp.linear_fc2.bias", h))
    return out


def moe_parameters(m: Any, lay: Layout, pre: str) -> list[Param]:
    """An MoE layer's router (replicated) and this rank's experts (E / EP of them, split over expert TP), in
    the registration order of Megatron-Core's `SequentialMLP` (TE's grouped GEMM holds the same elements)."""
    h, etp = m.hidden_size, lay.etp
    fe = lay.moe_ffn_hidden_size
    out = [Param(f"{pre}.mlp.router.weight", m.num_moe_experts * h)]
    if m.add_bias_linear:
        out.append(Param(f"{pre}.mlp.router.bias", m.num_moe_experts))
    fc1 = (2 if m.gated_linear_unit else 1) * fe // etp
    for j in range(m.num_moe_experts // lay.ep):
        e = f"{pre}.mlp.experts.local_experts.{j}"
        out.append(Param(f"{e}.linear_fc1.weight", fc1 * h, linear=True, expert=True))
        if m.add_bias_linear:
            out.append(Param(f"{e}.linear_fc1.bias", fc1, expert=True))
        out.append(Param(f"{e}.linear_fc2.weight", h * fe // etp, linear=True, expert=True))
        if m.add_bias_linear:
            out.append(Param(f"{e}.linear_fc2.bias", h, expert=True))
    return out


def chunk_parameters(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int, vp_stage: int) -> list[Param]:
    """Parameters of one model chunk (`GPTModel`) in `named_parameters()` order."""
    m = cfg.model
    pre = pp_rank == 0 and vp_stage == 0
    post = pp_rank == lay.pp - 1 and vp_stage == lay.vp - 1
    tied = m.share_embeddings_and_output_weights
    out: list[Param] = []
    if pre:
        out.append(Param("embedding.word_embeddings.weight", padded_vocab // lay.tp * m.hidden_size,
                         shared_embedding=tied and lay.pp > 1 and not post))
        if m.position_embedding_type == "learned_absolute":
            out.append(Param("embedding.position_embeddings.weight",
                             (m.max_position_embeddings or m.seq_length) * m.hidden_size))
    per_chunk = m.num_layers // (lay.pp * lay.vp)
    for i in range(per_chunk):
        out += layer_parameters(m, lay, i)
    if post:
        out += _norm_params("decoder.final_layernorm", m)
        if not (tied and pre):
            out.append(Param("output_layer.weight", padded_vocab // lay.tp * m.hidden_size,
                             shared_embedding=tied and not pre))
    return out


def _whole_model(cfg: Config, padded_vocab: int) -> list[Param]:
    par = cfg.parallel
    world = par.tensor * par.pipeline * par.context * par.expert * expert_tensor_size(cfg)
    lay = replace(layout_of(cfg, world, use_te=False), tp=1, pp=1, vp=1, ep=1, etp=1)
    return chunk_parameters(cfg, lay, padded_vocab, 0, 0)


def count_parameters(cfg: Config, padded_vocab: int) -> int:
    """Parameters of the whole model (one copy of tied embeddings; every expert)."""
    return sum(p.numel for p in _whole_model(cfg, padded_vocab))


def count_active_parameters(cfg: Config, padded_vocab: int) -> int:
    """Parameters one token uses: all but the experts it is not routed to (k of E per MoE layer)."""
    m = cfg.model
    params = _whole_model(cfg, padded_vocab)
    total = sum(p.numel for p in params)
    if not m.num_moe_experts:
        return total
    experts = sum(p.numel for p in params if p.expert)
    return total - experts + experts * m.moe_router_topk // m.num_moe_experts

