"""DeepSeek-V3 family (DeepSeek-V3, Moonlight, Kimi K2): Multi-Latent Attention, DeepSeek MoE routing, dense-first
layers and Multi-Token Prediction, all Megatron-Core's own modules (`MLASelfAttention`, the MoE layer with shared
experts, group-limited sigmoid routing with an expert bias, `MultiTokenPredictionBlock`).

HF `DeepseekV3ForCausalLM` ↔ ours: MLA projections q_a_proj / q_a_layernorm / q_b_proj (or q_proj without q LoRA),
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; routed experts, shared experts, `gate.weight` and
`gate.e_score_correction_bias` (Megatron's router `expert_bias`); the first `first_k_dense_replace` layers dense;
the MTP layer(s) as the released checkpoints keep them, extra decoder layers `model.layers.{num_hidden_layers + k}`
with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and copies of the embedding (`embed_tokens`) and output head
(`shared_head.head`). Both sides apply RoPE to the de-interleaved rope part (transformers' `rope_interleave`,
Megatron's MLA path), so every projection is copied as is.

Routing equals transformers' `DeepseekV3TopkRouter`: sigmoid scores, the bias only for choosing, groups ranked by
the sum of their top-2 scores (Megatron: top topk/group_topk, refused where that is not 2), top-k weights
renormalised and scaled by `routed_scaling_factor`. Shapes follow the released config.json files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from model_providers.core.family import Family, require
from model_providers.core.mapping import ConversionError, Copy, Duplicate, ExactCopy, GateUp, MappingRule, Vocab
from model_providers.core.yarn import refuse as _refuse
from model_providers.core.yarn import yarn_fields
from model_providers.llama import ROTARY_BUFFERS

# What makes a model a DeepSeek-V3 (checked on export, set on import).
_FIXED = {"normalization": "RMSNorm", "gated_linear_unit": True, "activation": "silu",
          "position_embedding_type": "rope", "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": True,
          "multi_latent_attention": True, "moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False,
          "moe_router_enable_expert_bias": True}
_COMMON = {"family": "deepseek_v3", **_FIXED, "share_embeddings_and_output_weights": False, "hidden_dropout": 0.0,
           "attention_dropout": 0.0, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
           "v_head_dim": 128, "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4,
           "moe_router_bias_update_rate": 1e-3, "moe_router_dtype": "fp32", "seq_length": 4096}
_YARN = {"rope_type": "yarn", "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0}


def _dense_first(layers: int, dense: int) -> list[int]:
    return [0] * dense + [1] * (layers - dense)


PRESETS: dict[str, dict] = {
    # CPU-sized: 4 layers (the first dense), MLA with LoRA ranks 32 (q) / 16 (kv), YaRN, 8 routed experts + 1
    # shared, top-2 within 1 of 2 groups, expert bias, MTP depth 1.
    "tiny_deepseek": {**_COMMON, "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128,
                      "num_attention_heads": 4, "num_query_groups": None, "seq_length": 128, "vocab_size": None,
                      "max_position_embeddings": 512, "layernorm_epsilon": 1e-6, "rotary_base": 10000.0,
                      "q_lora_rank": 32, "kv_lora_rank": 16, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8,
                      "v_head_dim": 16, **_YARN, "rotary_scaling_factor": 4.0, "original_max_position_embeddings": 128,
                      "num_moe_experts": 8, "moe_ffn_hidden_size": 32, "moe_shared_expert_intermediate_size": 32,
                      "moe_router_topk": 2, "moe_router_num_groups": 2, "moe_router_group_topk": 1,
                      "moe_router_topk_scaling_factor": 2.5, "moe_layer_freq": _dense_first(4, 1),
                      "mtp_num_layers": 1, "moe_aux_loss_coeff": 1e-3},
    # DeepSeek-V3 (and R1): 671B parameters, 37B active per token; the MTP module adds 11.5B (14B with its stored
    # copies of the embedding and head).
    "deepseek_v3": {**_COMMON, "num_layers": 61, "hidden_size": 7168, "ffn_hidden_size": 18432,
                    "num_attention_heads": 128, "num_query_groups": None, "vocab_size": 129280,
                    "max_position_embeddings": 163840, "layernorm_epsilon": 1e-6, "rotary_base": 10000.0,
                    "q_lora_rank": 1536, **_YARN, "rotary_scaling_factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                    "num_moe_experts": 256, "moe_ffn_hidden_size": 2048, "moe_shared_expert_intermediate_size": 2048,
                    "moe_router_topk": 8, "moe_router_num_groups": 8, "moe_router_group_topk": 4,
                    "moe_router_topk_scaling_factor": 2.5, "moe_layer_freq": _dense_first(61, 3),
                    "mtp_num_layers": 1},
    # Moonlight-16B-A3B (Moonshot AI): 16B parameters, 3B active; no q LoRA, plain RoPE, 2 shared experts.
    "moonlight_16b_a3b": {**_COMMON, "num_layers": 27, "hidden_size": 2048, "ffn_hidden_size": 11264,
                          "num_attention_heads": 16, "num_query_groups": None, "vocab_size": 163840,
                          "max_position_embeddings": 8192, "layernorm_epsilon": 1e-5, "rotary_base": 50000.0,
                          "q_lora_rank": None, "rope_type": "rope", "num_moe_experts": 64, "moe_ffn_hidden_size": 1408,
                          "moe_shared_expert_intermediate_size": 2816, "moe_router_topk": 6,
                          "moe_router_topk_scaling_factor": 2.446, "moe_layer_freq": _dense_first(27, 1)},
    # Kimi K2 (Moonshot AI): 1.04T parameters, 32B active; 384 experts, 64 heads, one dense layer.
    "kimi_k2": {**_COMMON, "num_layers": 61, "hidden_size": 7168, "ffn_hidden_size": 18432,
                "num_attention_heads": 64, "num_query_groups": None, "vocab_size": 163840,
                "max_position_embeddings": 131072, "layernorm_epsilon": 1e-6, "rotary_base": 50000.0,
                "q_lora_rank": 1536, **_YARN, "rotary_scaling_factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                "num_moe_experts": 384, "moe_ffn_hidden_size": 2048, "moe_shared_expert_intermediate_size": 2048,
                "moe_router_topk": 8, "moe_router_topk_scaling_factor": 2.827,
                "moe_layer_freq": _dense_first(61, 1)},
}

# --------------------------------------------------------------------------------------------------
# The mapping: templates over `{i}` (Megatron's per-layer keys: dense-first models store each layer under its own
# name, `decoder.layers.<i>.`), expanded per model by `DeepseekV3Family.mapping_for`.
# --------------------------------------------------------------------------------------------------

_M = "decoder.layers.{i}."
_L = "model.layers.{i}."
_A = _L + "self_attn."


def _attention(prefix: str, q_lora: bool) -> tuple[MappingRule, ...]:
    query = (Copy(prefix + "self_attention.linear_q_down_proj.weight", _A + "q_a_proj.weight"),
             Copy(prefix + "self_attention.linear_q_up_proj.layer_norm_weight", _A + "q_a_layernorm.weight"),
             Copy(prefix + "self_attention.linear_q_up_proj.weight", _A + "q_b_proj.weight")) if q_lora else \
        (Copy(prefix + "self_attention.linear_q_proj.weight", _A + "q_proj.weight"),)
    return (Copy(prefix + "input_layernorm.weight", _L + "input_layernorm.weight"), *query,
            Copy(prefix + "self_attention.linear_kv_down_proj.weight", _A + "kv_a_proj_with_mqa.weight"),
            Copy(prefix + "self_attention.linear_kv_up_proj.layer_norm_weight", _A + "kv_a_layernorm.weight"),
            Copy(prefix + "self_attention.linear_kv_up_proj.weight", _A + "kv_b_proj.weight"),
            Copy(prefix + "self_attention.linear_proj.weight", _A + "o_proj.weight"))


def _dense_mlp(prefix: str) -> tuple[MappingRule, ...]:
    return (Copy(prefix + "mlp.linear_fc1.layer_norm_weight", _L + "post_attention_layernorm.weight"),
            GateUp(prefix + "mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight")),
            Copy(prefix + "mlp.linear_fc2.weight", _L + "mlp.down_proj.weight"))


def _moe_mlp(prefix: str, shared: bool) -> tuple[MappingRule, ...]:
    e = _L + "mlp.experts.{e}."
    s = _L + "mlp.shared_experts."
    shared_rules = (
        GateUp(prefix + "mlp.shared_experts.linear_fc1.weight", (s + "gate_proj.weight", s + "up_proj.weight")),
        Copy(prefix + "mlp.shared_experts.linear_fc2.weight", s + "down_proj.weight")) if shared else ()
    return (Copy(prefix + "pre_mlp_layernorm.weight", _L + "post_attention_layernorm.weight"),
            Copy(prefix + "mlp.router.weight", _L + "mlp.gate.weight"),
            ExactCopy(prefix + "mlp.router.expert_bias", _L + "mlp.gate.e_score_correction_bias"),
            GateUp(prefix + "mlp.experts.experts.linear_fc1.weight", (e + "gate_proj.weight", e + "up_proj.weight")),
            Copy(prefix + "mlp.experts.experts.linear_fc2.weight", e + "down_proj.weight"), *shared_rules)


def _mtp_layer(q_lora: bool, shared: bool) -> tuple[MappingRule, ...]:
    """One MTP layer (`mtp.layers.{i}.`; HF layer num_hidden_layers + i): its norms, projection, MoE layer, and
    the copies of the embedding and output head that released checkpoints store beside them."""
    p = "mtp.layers.{i}."
    t = p + "transformer_layer."
    return (Copy(p + "enorm.weight", _L + "enorm.weight"), Copy(p + "hnorm.weight", _L + "hnorm.weight"),
            Copy(p + "eh_proj.weight", _L + "eh_proj.weight"),
            Copy(p + "final_layernorm.weight", _L + "shared_head.norm.weight"),
            *_attention(t, q_lora), *_moe_mlp(t, shared),
            Duplicate("embedding.word_embeddings.weight", _L + "embed_tokens.weight", "model.embed_tokens.weight"),
            Duplicate("output_layer.weight", _L + "shared_head.head.weight", "lm_head.weight"))


_GLOBAL = (Vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
           Copy("decoder.final_layernorm.weight", "model.norm.weight"),
           Vocab("output_layer.weight", "lm_head.weight"))
# Every rule the family can produce (the registry's table; `mapping_for` picks and expands them per model).
MAPPING = (*_GLOBAL, *_attention(_M, True), *_attention(_M, False)[1:2], *_dense_mlp(_M), *_moe_mlp(_M, True),
           *_mtp_layer(True, True))


def first_k_dense(m: Any) -> int:
    """The number of dense layers in front (DeepSeek's `first_k_dense_replace`); ConversionError for any other
    layer pattern."""
    layers = m.num_layers
    freq = m.moe_layer_freq
    pattern = [1 if i % freq == 0 else 0 for i in range(layers)] if isinstance(freq, int) else list(freq)
    k = pattern.index(1) if 1 in pattern else layers
    if pattern != _dense_first(layers, k) or k == layers:
        raise ConversionError(f"model.moe_layer_freq={freq!r} cannot be expressed as DeepseekV3ForCausalLM (needs "
                              "dense layers first, then MoE layers: first_k_dense_replace)")
    return k


def _rope_parameters(m: Any) -> dict:
    rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if m.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=float(m.rotary_scaling_factor),
                    original_max_position_embeddings=int(m.original_max_position_embeddings),
                    beta_fast=float(m.beta_fast), beta_slow=float(m.beta_slow), mscale=float(m.mscale),
                    mscale_all_dim=float(m.mscale_all_dim))
    return rope


def _rope_fields(hf: Any) -> dict:
    """Our RoPE fields for a DeepseekV3Config (ConversionError for what Megatron's MLA RoPE cannot compute)."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rtype = rope.get("rope_type", rope.get("type", "default"))
    fields: dict[str, Any] = {"rotary_base": float(rope.get("rope_theta", 10000.0)), "rotary_percent": 1.0,
                              "rope_type": "rope", "rotary_scaling_factor": 1.0}
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError(f"config.json: rope_scaling.partial_rotary_factor={rope['partial_rotary_factor']} is "
                              "not supported")
    if rtype == "default":
        return fields
    if rtype != "yarn":
        raise ConversionError(f"config.json: rope_scaling type {rtype!r} is not supported (supported: default, yarn)")
    if rope.get("truncate", True) is not True:
        raise ConversionError("config.json: rope_scaling.truncate=false is not supported (Megatron-Core rounds the "
                              "YaRN correction range)")
    return {**fields, "rope_type": "yarn", **yarn_fields(hf, rope, keep_mscale_all_dim=True)}


class DeepseekV3Family(Family):
    """DeepseekV3ForCausalLM: MLA, dense-first DeepSeek MoE with shared experts and an expert bias, MTP."""

    def mapping_for(self, m: Any) -> tuple[MappingRule, ...]:
        """The rules of model `m`, one per Megatron key (per layer: dense-first models key each layer apart)."""
        q_lora, shared = m.q_lora_rank is not None, bool(m.moe_shared_expert_intermediate_size)
        k = first_k_dense(m) if m.num_moe_experts else m.num_layers
        rules: list[MappingRule] = list(_GLOBAL)
        for i in range(m.num_layers):
            mlp = _dense_mlp(_M) if i < k else _moe_mlp(_M, shared)
            rules += [r.at(i, i) for r in (*_attention(_M, q_lora), *mlp)]
        for j in range(m.mtp_num_layers or 0):
            rules += [r.at(j, m.num_layers + j) for r in _mtp_layer(q_lora, shared)]
        return tuple(rules)

    def config_for_weights(self, hf_cfg: Any, names: Callable[[], set[str]]) -> tuple[Any, str | None]:
        """Without any MTP tensor (transformers' `save_pretrained` drops them) the model is imported without MTP."""
        import copy

        mtp, layers = int(getattr(hf_cfg, "num_nextn_predict_layers", 0) or 0), hf_cfg.num_hidden_layers
        if not mtp or any(n.startswith(f"model.layers.{layers}.") for n in names()):
            return hf_cfg, None
        out = copy.deepcopy(hf_cfg)
        out.num_nextn_predict_layers = 0
        return out, (f"config.json: num_nextn_predict_layers={mtp} but the weights have no MTP layer "
                     f"(model.layers.{layers}.*; transformers' save_pretrained leaves it out): imported without MTP "
                     "(model.mtp_num_layers=1 trains a new one)")

    def hf_shapes(self, hf_cfg: Any) -> dict[str, tuple[int, ...]]:
        """transformers' tensors plus the MTP layers it does not build (the last decoder layer's shapes, the
        norms, eh_proj and the embedding/head copies), as released checkpoints store them."""
        shapes = super().hf_shapes(hf_cfg)
        layers, h = hf_cfg.num_hidden_layers, hf_cfg.hidden_size
        last = f"model.layers.{layers - 1}."
        for j in range(int(getattr(hf_cfg, "num_nextn_predict_layers", 0) or 0)):
            p = f"model.layers.{layers + j}."
            shapes.update({p + k[len(last):]: v for k, v in list(shapes.items()) if k.startswith(last)})
            vocab = shapes["model.embed_tokens.weight"]
            shapes.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
                           p + "shared_head.norm.weight": (h,), p + "embed_tokens.weight": vocab,
                           p + "shared_head.head.weight": vocab})
        return shapes

    def to_hf_config(self, m: Any, vocab: int, *, bos: int | None, eos: int | None, dtype: Any,
                     base: Any = None) -> Any:
        import transformers

        arch = self.hf_architecture
        self.require_fixed_fields(m)
        require(m, "rotary_percent", 1.0, arch)
        require(m, "sliding_window", None, arch)
        if m.num_moe_experts is None:
            raise ConversionError(f"model.num_moe_experts is null: a {arch} needs experts")
        if m.num_query_groups not in (None, m.num_attention_heads):
            raise ConversionError(f"model.num_query_groups={m.num_query_groups}: MLA has no key/value groups")
        moe_ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size
        shared = m.moe_shared_expert_intermediate_size or 0
        if shared % moe_ffn:
            raise ConversionError(f"model.moe_shared_expert_intermediate_size={shared} is not a multiple of the "
                                  f"expert size {moe_ffn} ({arch} counts whole shared experts)")
        groups, group_topk = m.moe_router_num_groups or 1, m.moe_router_group_topk or 1
        if groups > group_topk and m.moe_router_topk // group_topk != 2:
            raise ConversionError(f"model.moe_router_topk={m.moe_router_topk} / moe_router_group_topk={group_topk} "
                                  f"!= 2: {arch} ranks expert groups by their top-2 scores")
        fields = dict(
            vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size or 4 * m.hidden_size,
            moe_intermediate_size=moe_ffn, num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_attention_heads, n_shared_experts=shared // moe_ffn,
            n_routed_experts=m.num_moe_experts, routed_scaling_factor=float(m.moe_router_topk_scaling_factor or 1.0),
            kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank, qk_rope_head_dim=m.qk_pos_emb_head_dim,
            v_head_dim=m.v_head_dim, qk_nope_head_dim=m.qk_head_dim, n_group=groups, topk_group=group_topk,
            num_experts_per_tok=m.moe_router_topk, first_k_dense_replace=first_k_dense(m), norm_topk_prob=True,
            hidden_act="silu", max_position_embeddings=m.max_position_embeddings or m.seq_length,
            rms_norm_eps=m.layernorm_epsilon, tie_word_embeddings=m.share_embeddings_and_output_weights,
            rope_parameters=_rope_parameters(m), rope_interleave=True, attention_bias=False,
            attention_dropout=m.attention_dropout, num_nextn_predict_layers=m.mtp_num_layers or 0,
            scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, aux_loss_alpha=m.moe_aux_loss_coeff,
            seq_aux=m.moe_router_load_balancing_type == "seq_aux_loss", architectures=[arch],
            dtype=str(dtype).removeprefix("torch."))
        released = (base or {}).get("rope_scaling") or {}
        if "type" in released and m.rope_type == "yarn":  # the pre-v5 spelling transformers keeps beside rope_type
            fields["rope_parameters"]["type"] = released["type"]
        return self.hf_config(transformers.DeepseekV3Config, fields, bos=bos, eos=eos, base=base)

    def config_json(self, hf_cfg: Any) -> dict:
        """As released DeepSeek-V3 configs spell it: `rope_theta` and `rope_scaling` (type yarn) beside transformers'
        `rope_parameters`."""
        out = hf_cfg.to_diff_dict()
        rope = out.get("rope_parameters") or hf_cfg.rope_parameters
        out["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type") == "yarn":
            out["rope_scaling"] = {**{k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")},
                                   "type": "yarn"}
            out.pop("rope_parameters", None)  # read back from rope_scaling, as a released config is
        for key in ("num_nextn_predict_layers", "first_k_dense_replace", "n_group", "topk_group", "scoring_func",
                    "topk_method", "routed_scaling_factor", "moe_layer_freq", "norm_topk_prob", "q_lora_rank"):
            out[key] = getattr(hf_cfg, key)
        return out

    def from_hf_config(self, hf: Any) -> dict:
        layers, experts = hf.num_hidden_layers, hf.n_routed_experts
        topk, groups, group_topk = hf.num_experts_per_tok, hf.n_group or 1, hf.topk_group or 1
        _refuse(hf, "hidden_act", hf.hidden_act == "silu", "only silu (SwiGLU)")
        _refuse(hf, "scoring_func", getattr(hf, "scoring_func", "sigmoid") == "sigmoid",
                "transformers' DeepseekV3 scores with sigmoid")
        _refuse(hf, "topk_method", getattr(hf, "topk_method", "noaux_tc") == "noaux_tc",
                "transformers' DeepseekV3 routes with noaux_tc")
        _refuse(hf, "norm_topk_prob", bool(hf.norm_topk_prob) and topk > 1,
                "Megatron-Core renormalises sigmoid top-k weights, for k > 1")
        _refuse(hf, "rope_interleave", hf.rope_interleave is not False, "only the interleaved layout")
        _refuse(hf, "attention_bias", not hf.attention_bias, "MLA projections without biases")
        _refuse(hf, "moe_layer_freq", getattr(hf, "moe_layer_freq", 1) == 1,
                "transformers' DeepseekV3 makes every layer after first_k_dense_replace MoE")
        _refuse(hf, "num_key_value_heads", hf.num_key_value_heads in (None, hf.num_attention_heads),
                "MLA has no key/value groups")
        _refuse(hf, "first_k_dense_replace", 0 <= hf.first_k_dense_replace < layers, "needs MoE layers")
        _refuse(hf, "n_group", experts % groups == 0, f"{experts} experts split into equal groups")
        _refuse(hf, "topk_group", group_topk <= groups, f"at most n_group={groups} groups to choose from")
        _refuse(hf, "topk_group", groups == group_topk or topk // group_topk == 2,
                "Megatron-Core ranks groups by their top num_experts_per_tok/topk_group scores, transformers by 2")
        mtp = int(getattr(hf, "num_nextn_predict_layers", 0) or 0)
        aux = float(getattr(hf, "aux_loss_alpha", 0.0) or 0.0)
        context = int(hf.max_position_embeddings)
        return {
            **self.fixed_fields, "family": self.name, "num_layers": layers, "hidden_size": hf.hidden_size,
            "ffn_hidden_size": hf.intermediate_size, "num_attention_heads": hf.num_attention_heads,
            "num_query_groups": None, "kv_channels": None, "layernorm_epsilon": float(hf.rms_norm_eps),
            "share_embeddings_and_output_weights": bool(hf.tie_word_embeddings), "vocab_size": hf.vocab_size,
            "max_position_embeddings": context, "seq_length": min(context, 4096), "sliding_window": None,
            "hidden_dropout": 0.0, "attention_dropout": float(hf.attention_dropout or 0.0),
            "q_lora_rank": hf.q_lora_rank, "kv_lora_rank": hf.kv_lora_rank, "qk_head_dim": hf.qk_nope_head_dim,
            "qk_pos_emb_head_dim": hf.qk_rope_head_dim, "v_head_dim": hf.v_head_dim, **_rope_fields(hf),
            "num_moe_experts": experts, "moe_ffn_hidden_size": hf.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": (hf.n_shared_experts * hf.moe_intermediate_size) or None,
            "moe_router_topk": topk, "moe_router_num_groups": groups if groups > 1 else None,
            "moe_router_group_topk": group_topk if groups > 1 else None,
            "moe_router_topk_scaling_factor": float(hf.routed_scaling_factor),
            "moe_layer_freq": _dense_first(layers, hf.first_k_dense_replace),
            "moe_router_load_balancing_type": "seq_aux_loss" if getattr(hf, "seq_aux", True) else "aux_loss",
            "moe_aux_loss_coeff": aux, "mtp_num_layers": mtp or None,
        }


FAMILY = DeepseekV3Family(name="deepseek_v3", hf_architecture="DeepseekV3ForCausalLM", hf_model_type="deepseek_v3",
                          presets=PRESETS, mapping=MAPPING, fixed_fields=_FIXED, hf_ignored=ROTARY_BUFFERS)
