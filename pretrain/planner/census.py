"""Parameter census: every parameter of one rank's model chunks, named and sized as Megatron-Core's local
spec registers them (the Transformer Engine spec holds the same elements)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from model_providers.core import hybrid
from pretrain.compat.mcore import mtp_layer_name
from pretrain.config import Config, ModelConfig
from pretrain.layout import Layout, expert_tensor_size
from pretrain.planner import linear_attention, mamba
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


def is_moe_layer(m: Any, index: int) -> bool:
    """Whether global decoder layer `index` is an MoE layer (Megatron-Core's `moe_layer_freq` rule)."""
    if not m.num_moe_experts:
        return False
    freq = m.moe_layer_freq
    return bool(freq[index]) if isinstance(freq, list) else index % freq == 0


def mla_parameters(m: Any, lay: Layout, pre: str) -> list[Param]:
    """Multi-Latent Attention's projections and latent norms on one TP rank, after `linear_proj`.

    The up-projections are column-parallel. The down-projections are column-parallel on the local spec and
    duplicated (whole on every TP rank) with Transformer Engine; the latent norms are replicated."""
    h, a, tp = m.hidden_size, m.num_attention_heads, lay.tp
    q_width = a * (m.qk_head_dim + m.qk_pos_emb_head_dim)
    down = 1 if lay.use_te else tp
    att = f"{pre}.self_attention"
    out = []
    if m.q_lora_rank is None:
        out.append(Param(f"{att}.linear_q_proj.weight", q_width // tp * h, linear=True))
    else:
        out += [Param(f"{att}.linear_q_down_proj.weight", m.q_lora_rank // down * h, linear=True),
                Param(f"{att}.linear_q_up_proj.weight", q_width // tp * m.q_lora_rank, linear=True)]
    out += [Param(f"{att}.linear_kv_down_proj.weight", (m.kv_lora_rank + m.qk_pos_emb_head_dim) // down * h,
                  linear=True),
            Param(f"{att}.linear_kv_up_proj.weight", a * (m.qk_head_dim + m.v_head_dim) // tp * m.kv_lora_rank,
                  linear=True)]
    if m.qk_layernorm:
        if m.q_lora_rank is not None:
            out.append(Param(f"{att}.q_layernorm.weight", m.q_lora_rank))
        out.append(Param(f"{att}.kv_layernorm.weight", m.kv_lora_rank))
    return out


def layer_parameters(m: Any, lay: Layout, index: int, global_index: int | None = None,
                     pre: str | None = None) -> list[Param]:
    """One decoder layer's parameters on one TP rank, in Megatron's local-spec registration order.

    `global_index` decides dense or MoE (dense-first models); `pre` the name prefix (an MTP layer's
    `mtp.layers.{j}.transformer_layer`, `mtp_model_layer` from 0.17: `compat.mcore.mtp_layer_name`)."""
    h, a, tp = m.hidden_size, m.num_attention_heads, lay.tp
    g, d = lay.num_query_groups, lay.head_dim
    pre = pre or f"decoder.layers.{index}"
    out = _norm_params(f"{pre}.input_layernorm", m)
    gi = index if global_index is None else global_index
    if linear_attention.is_linear_layer(m, gi):  # Gated DeltaNet instead of attention (planner/linear_attention.py)
        out += [Param(n, k, linear=lin) for n, k, lin in linear_attention.gdn_parameters(m, tp, pre)]
        return out + _mlp_parameters(m, lay, pre, gi)
    value = m.v_head_dim if m.multi_latent_attention else d
    if getattr(m, "softmax_type", "vanilla") == "learnable":  # attention sinks: one logit per head, split over TP
        out.append(Param(f"{pre}.self_attention.core_attention.softmax_offset", a // tp))
    out.append(Param(f"{pre}.self_attention.linear_proj.weight", h * a * value // tp, linear=True))
    if m.add_bias_linear:
        out.append(Param(f"{pre}.self_attention.linear_proj.bias", h))
    if m.multi_latent_attention:
        out += mla_parameters(m, lay, pre)
    else:
        qkv = ((a + 2 * g) * d + linear_attention.gate_rows(m)) // tp  # + the output gate's rows
        out.append(Param(f"{pre}.self_attention.linear_qkv.weight", qkv * h, linear=True))
        if m.add_bias_linear or m.add_qkv_bias:
            out.append(Param(f"{pre}.self_attention.linear_qkv.bias", qkv))
        if m.qk_layernorm:  # per-head norms of queries and keys, replicated across TP
            out += [Param(f"{pre}.self_attention.{n}_layernorm.weight", d) for n in ("q", "k")]
    return out + _mlp_parameters(m, lay, pre, gi)


def _mlp_parameters(m: Any, lay: Layout, pre: str, global_index: int) -> list[Param]:
    """The pre-MLP norm and the dense MLP or MoE of one layer on one TP rank."""
    h, f, tp = m.hidden_size, lay.ffn_hidden_size, lay.tp
    out = _norm_params(f"{pre}.pre_mlp_layernorm", m)
    if is_moe_layer(m, global_index):
        return out + moe_parameters(m, lay, pre)
    fc1 = (2 if m.gated_linear_unit else 1) * f // tp
    out.append(Param(f"{pre}.mlp.linear_fc1.weight", fc1 * h, linear=True))
    if m.add_bias_linear:
        out.append(Param(f"{pre}.mlp.linear_fc1.bias", fc1))
    out.append(Param(f"{pre}.mlp.linear_fc2.weight", h * f // tp, linear=True))
    if m.add_bias_linear:
        out.append(Param(f"{pre}.mlp.linear_fc2.bias", h))
    return out


def hybrid_layer_parameters(m: Any, lay: Layout, index: int, global_index: int, kind: str | None = None,
                            pre: str | None = None) -> list[Param]:
    """One layer of a hybrid model (Megatron-Core's `MambaStack`), by its pattern symbol (`kind`; None: the decoder
    pattern's at `global_index`): a Mamba mixer and its norm (`pretrain.planner.mamba`), or the attention / MLP / MoE
    half of a decoder layer with its norm. `pre`: the name prefix (an MTP depth's `mtp.layers.{d}.mtp_model_layer.
    layers.{j}`)."""
    pre = pre or f"decoder.layers.{index}"
    kind = kind or m.hybrid_layer_pattern[global_index]
    if kind == hybrid.MAMBA:
        return [Param(n, k, linear=g) for n, k, g in mamba.mixer_parameters(m, lay, pre)] + \
            _norm_params(f"{pre}.norm", m)
    model = m if kind == hybrid.MOE else replace(m, num_moe_experts=None)
    keep = ("input_layernorm", "self_attention") if kind == hybrid.ATTENTION else ("pre_mlp_layernorm", ".mlp.")
    return [p for p in layer_parameters(model, lay, index, global_index=0, pre=pre) if any(k in p.name for k in keep)]


def routed_width(m: Any) -> int:
    """The width of one routed token copy: what the dispatcher moves and an expert's fc1 reads. LatentMoE projects
    the tokens to `moe_latent_size` before the dispatch and back after the combine (Megatron-Core's
    `MoELayer.preprocess` runs `fc1_latent_proj` before `dispatch_preprocess`); else the hidden size."""
    return m.moe_latent_size or m.hidden_size


def moe_parameters(m: Any, lay: Layout, pre: str) -> list[Param]:
    """An MoE layer's router (replicated) and this rank's experts (E / EP of them, split over expert TP), in
    the registration order of Megatron-Core's `SequentialMLP` (TE's grouped GEMM holds the same elements)."""
    h, etp = m.hidden_size, lay.etp
    fe = lay.moe_ffn_hidden_size
    out = [Param(f"{pre}.mlp.router.weight", m.num_moe_experts * h)]
    if m.add_bias_linear:
        out.append(Param(f"{pre}.mlp.router.bias", m.num_moe_experts))
    if m.moe_latent_size:  # LatentMoE: h → latent before the experts, latent → h after (duplicated over TP)
        out += [Param(f"{pre}.mlp.fc1_latent_proj.weight", m.moe_latent_size * h, linear=True),
                Param(f"{pre}.mlp.fc2_latent_proj.weight", h * m.moe_latent_size, linear=True)]
        h = routed_width(m)  # the experts' input and output width
    fc1 = (2 if m.gated_linear_unit else 1) * fe // etp
    for j in range(m.num_moe_experts // lay.ep):
        e = f"{pre}.mlp.experts.local_experts.{j}"
        out.append(Param(f"{e}.linear_fc1.weight", fc1 * h, linear=True, expert=True))
        if m.add_bias_linear:
            out.append(Param(f"{e}.linear_fc1.bias", fc1, expert=True))
        out.append(Param(f"{e}.linear_fc2.weight", h * fe // etp, linear=True, expert=True))
        if m.add_bias_linear:
            out.append(Param(f"{e}.linear_fc2.bias", h, expert=True))
    shared, h = m.moe_shared_expert_intermediate_size, m.hidden_size
    if shared:  # shared experts: one dense MLP, split over TP like the attention
        fs = (2 if m.gated_linear_unit else 1) * shared // lay.tp
        out += [Param(f"{pre}.mlp.shared_experts.linear_fc1.weight", fs * h, linear=True),
                Param(f"{pre}.mlp.shared_experts.linear_fc2.weight", h * shared // lay.tp, linear=True)]
        if getattr(m, "moe_shared_expert_gate", False):  # sigmoid(x · w) on the shared expert's output
            out.append(Param(f"{pre}.mlp.shared_experts.gate_weight", h))
    return out


def mtp_parameters(m: Any, lay: Layout) -> list[Param]:
    """The Multi-Token Prediction layers (on the last pipeline stage): embedding and hidden norms, the projection
    of their concatenation (column-parallel, 2h → h), a transformer layer like the decoder's last, a final norm."""
    h = m.hidden_size
    out: list[Param] = []
    for j in range(m.mtp_num_layers or 0):
        pre = f"mtp.layers.{j}"
        out += _norm_params(f"{pre}.enorm", m) + _norm_params(f"{pre}.hnorm", m)
        out.append(Param(f"{pre}.eh_proj.weight", h // lay.tp * 2 * h, linear=True))
        if hybrid.is_hybrid(m):  # a hybrid depth: model.mtp_layer_pattern's layers
            out += [p for i, kind in enumerate(hybrid.mtp_pattern(m)) for p in hybrid_layer_parameters(
                m, lay, i, 0, kind=kind, pre=f"{pre}.mtp_model_layer.layers.{i}")]
        else:
            out += layer_parameters(m, lay, 0, global_index=m.num_layers - 1, pre=f"{pre}.{mtp_layer_name}")
        out += _norm_params(f"{pre}.final_layernorm", m)
    return out


def chunk_parameters(m: ModelConfig, lay: Layout, padded_vocab: int, pp_rank: int, vp_stage: int) -> list[Param]:
    """Parameters of one model chunk (`GPTModel`) in `named_parameters()` order."""
    pre = pp_rank == 0 and vp_stage == 0
    post = pp_rank == lay.pp - 1 and vp_stage == lay.vp - 1
    tied = m.share_embeddings_and_output_weights
    mtp = bool(m.mtp_num_layers) and post  # MTP layers on the last stage, with their own embedding copy there
    out: list[Param] = []
    if pre or mtp:
        out.append(Param("embedding.word_embeddings.weight", padded_vocab // lay.tp * m.hidden_size,
                         shared_embedding=(tied or bool(m.mtp_num_layers)) and lay.pp > 1 and not (pre and post)))
        if m.position_embedding_type == "learned_absolute":
            out.append(Param("embedding.position_embeddings.weight",
                             (m.max_position_embeddings or m.seq_length) * m.hidden_size))
    offset, per_chunk = lay.chunk_layers(m.num_layers, pp_rank, vp_stage)
    for i in range(per_chunk):
        out += hybrid_layer_parameters(m, lay, i, offset + i) if hybrid.is_hybrid(m) else \
            layer_parameters(m, lay, i, global_index=offset + i)
    if post:
        out += _norm_params("decoder.final_norm" if hybrid.is_hybrid(m) else "decoder.final_layernorm", m)
        out += mtp_parameters(m, lay) if mtp else []
        if not (tied and pre):
            out.append(Param("output_layer.weight", padded_vocab // lay.tp * m.hidden_size,
                             shared_embedding=tied and not pre))
    return out


def _whole_model(cfg: Config, padded_vocab: int, lay: Layout | None = None) -> list[Param]:
    """The whole model's parameters: as on one rank of `lay` (the plan's layout; None: derived here) unsharded."""
    if lay is None:
        par = cfg.parallel
        world = par.tensor * par.pipeline * par.context * par.expert * expert_tensor_size(par)
        lay = layout_of(cfg, world)
    lay = replace(lay, tp=1, pp=1, vp=1, ep=1, etp=1, use_te=False)
    return chunk_parameters(cfg.model, lay, padded_vocab, 0, 0)


def _without_mtp(params: list[Param]) -> list[Param]:
    return [p for p in params if not p.name.startswith("mtp.")]


def count_parameters(cfg: Config, padded_vocab: int, mtp: bool = False, lay: Layout | None = None) -> int:
    """Parameters of the whole model (one copy of tied embeddings; every expert). `mtp`: with the Multi-Token
    Prediction layers (which share the model's embedding and output head); without, the model as published.
    `lay`: the plan's layout (None: derived here)."""
    params = _whole_model(cfg, padded_vocab, lay)
    return sum(p.numel for p in (params if mtp else _without_mtp(params)))


def count_mtp_parameters(cfg: Config, padded_vocab: int, lay: Layout | None = None) -> int:
    """The MTP layers' own parameters (embedding and head are the model's)."""
    return count_parameters(cfg, padded_vocab, mtp=True, lay=lay) - count_parameters(cfg, padded_vocab, lay=lay)


def count_active_parameters(cfg: Config, padded_vocab: int, lay: Layout | None = None) -> int:
    """Parameters one token uses: all but the experts it is not routed to (k of E per MoE layer); without MTP."""
    m = cfg.model
    params = _without_mtp(_whole_model(cfg, padded_vocab, lay))
    total = sum(p.numel for p in params)
    if not m.num_moe_experts:
        return total
    experts = sum(p.numel for p in params if p.expert)
    return total - experts + experts * m.moe_router_topk // m.num_moe_experts



def count_checkpoint_elements(cfg: Config, vocab: int, lay: Layout | None = None) -> int:
    """Elements of the model's released-style HF checkpoint (true vocabulary `vocab`): every parameter, MTP layers
    included; the routers' expert biases (Megatron buffers, HF `e_score_correction_bias` tensors); and the copies of
    the embedding and output head each MTP layer stores."""
    m = cfg.model
    total = count_parameters(cfg, vocab, mtp=True, lay=lay)
    if m.num_moe_experts and m.moe_router_enable_expert_bias:
        moe_layers = sum(is_moe_layer(m, i) for i in range(m.num_layers)) + (m.mtp_num_layers or 0)
        total += moe_layers * m.num_moe_experts
    return total + 2 * vocab * m.hidden_size * (m.mtp_num_layers or 0)
