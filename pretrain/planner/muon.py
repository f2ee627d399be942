"""Muon in the plan (optimizer.name=muon): its optimizer state per rank and its Newton-Schulz FLOPs per step.

Megatron-Core's split (`pretrain.optim.muon`): every 2-D weight but the embedding and output layer to Muon (one
fp32 momentum buffer per element), the rest to AdamW (two fp32 moments); 16-bit runs keep an fp32 main copy of
every parameter the rank updates. Without `optimizer.muon.layer_wise` every data-parallel rank updates everything;
with it, Megatron-Core's LayerWiseDistributedOptimizer deals the whole tensors out over (expert) data parallel,
sorted by size in a ping-pong order, and after the step all-gathers them: one flat buffer of every tensor of the
group in the parameter dtype (`gather_bytes`, transient during the step).

Newton-Schulz on an m×n matrix (m ≤ n) costs `steps · (4m²n + 2m³)` FLOPs (XXᵀ, A², BX); the fused QKV weight is
three matrices (Q, K, V) with optimizer.muon.split_qkv. tp_mode=blockwise orthogonalises each TP shard alone,
duplicated the gathered whole matrix on every TP rank, distributed the whole matrix split over TP.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pretrain.config import Config, ModelConfig, MuonConfig
from pretrain.layout import Layout
from pretrain.planner.census import Param, chunk_parameters

_MATRIX = re.compile(r"\.weight\d*$")  # TE's grouped experts: weight0, weight1, ...


def is_muon_param(p: Param) -> bool:
    """Whether Megatron-Core gives this parameter to Muon: 2-D, not the embedding or output layer."""
    if not _MATRIX.search(p.name) or p.name.startswith(("embedding.", "output_layer.")):
        return False
    module = p.name.rsplit(".", 2)[-2]
    return "norm" not in module  # input_layernorm, q_layernorm, final_layernorm, enorm, hnorm: 1-D


def _inner_dim(p: Param, m: ModelConfig) -> int:
    """The input width of a Muon matrix (its columns): the hidden size but for MLA's up-projections."""
    if p.name.endswith("linear_kv_up_proj.weight"):
        return m.kv_lora_rank
    if p.name.endswith("linear_q_up_proj.weight"):
        return m.q_lora_rank
    if p.name.endswith("linear_proj.weight") or p.name.endswith("linear_fc2.weight"):
        return p.numel // m.hidden_size  # [hidden, inner]: rows are the hidden size
    return m.hidden_size


def _ns_flops(rows: int, cols: int, steps: int) -> int:
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def ns_flops(p: Param, m: ModelConfig, mu: MuonConfig, lay: Layout) -> int:
    """Newton-Schulz FLOPs of one optimizer step on this rank's shard `p` (as optimizer.muon.tp_mode runs it; `m`:
    the model section, `mu`: optimizer.muon)."""
    cols = _inner_dim(p, m)
    rows = p.numel // cols
    tp = lay.etp if p.expert else lay.tp
    parts = [rows]
    if mu.split_qkv and p.name.endswith("linear_qkv.weight"):
        a, g = m.num_attention_heads, lay.num_query_groups
        parts = [rows * a // (a + 2 * g), rows * g // (a + 2 * g), rows * g // (a + 2 * g)]
    if mu.tp_mode == "blockwise" or tp == 1:
        return sum(_ns_flops(r, cols, mu.num_ns_steps) for r in parts)
    whole = sum(_ns_flops(r * tp, cols, mu.num_ns_steps) for r in parts)  # the gathered matrix
    return whole if mu.tp_mode == "duplicated" else whole // tp


@dataclass(frozen=True)
class MuonMemory:
    """One rank's Muon + AdamW optimizer state (bytes) and Newton-Schulz work."""

    muon_params: int  # elements updated by Muon on this rank
    adamw_params: int
    momentum: int  # Muon's fp32 momentum buffers
    moments: int  # AdamW's two fp32 moments
    main_params: int  # fp32 main copies (16-bit runs)
    gather_bytes: int  # the layer-wise optimizer's all-gather buffers, during the step
    ns_flops: int  # Newton-Schulz FLOPs per optimizer step

    @property
    def optimizer(self) -> int:
        return self.momentum + self.moments + self.main_params


def _deal(params: list[Param], ranks: int, rank: int | None) -> list[Param]:
    """The tensors of `rank` under the layer-wise optimizer's deal (None: the rank with the most elements)."""
    if ranks == 1:
        return params
    order = list(range(ranks)) + list(range(ranks))[::-1]
    shares: list[list[Param]] = [[] for _ in range(ranks)]
    for i, p in enumerate(sorted(params, key=lambda q: q.numel)):
        shares[order[i % len(order)]].append(p)
    if rank is not None:
        return shares[rank]
    return max(shares, key=lambda s: sum(p.numel for p in s))


def muon_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int, dp_rank: int | None = None,
                edp_rank: int | None = None) -> MuonMemory:
    """Optimizer state, all-gather buffers and Newton-Schulz FLOPs of one rank training with Muon (`cfg`: the model
    and optimizer sections)."""
    params = [p for v in range(lay.vp) for p in chunk_parameters(cfg.model, lay, padded_vocab, pp_rank, v)]
    layer_wise = cfg.optimizer.muon.layer_wise
    dense = [p for p in params if not p.expert]
    expert = [p for p in params if p.expert]
    mine = params
    gather = 0
    if layer_wise:
        mine = _deal(dense, lay.dp * lay.cp, dp_rank) + _deal(expert, lay.edp, edp_rank)
        gather = sum(p.numel for p in dense if lay.dp * lay.cp > 1) + sum(p.numel for p in expert if lay.edp > 1)
        gather *= lay.bytes_per_value
    muon = [p for p in mine if is_muon_param(p)]
    adamw = [p for p in mine if not is_muon_param(p)]
    n_muon, n_adam = sum(p.numel for p in muon), sum(p.numel for p in adamw)
    main = 4 * (n_muon + n_adam) if lay.precision in ("bf16", "fp16") else 0
    flops = sum(ns_flops(p, cfg.model, cfg.optimizer.muon, lay) for p in muon)
    return MuonMemory(muon_params=n_muon, adamw_params=n_adam, momentum=4 * n_muon, moments=8 * n_adam,
                      main_params=main, gather_bytes=gather, ns_flops=flops)


def muon_section(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int) -> dict | None:
    """The plan's "muon" entry (None when training with AdamW): the most loaded rank of stage `pp_rank`."""
    if cfg.optimizer.name != "muon":
        return None
    mu = muon_memory(cfg, lay, padded_vocab, pp_rank)
    gib = 1024 ** 3
    return {"layer_wise": cfg.optimizer.muon.layer_wise, "muon_parameters": mu.muon_params,
            "adamw_parameters": mu.adamw_params, "momentum_gib": round(mu.momentum / gib, 3),
            "adamw_moments_gib": round(mu.moments / gib, 3), "main_params_gib": round(mu.main_params / gib, 3),
            "optimizer_gib": round(mu.optimizer / gib, 3), "gather_gib": round(mu.gather_bytes / gib, 3),
            "newton_schulz_flops_per_step": mu.ns_flops}
