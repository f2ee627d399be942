"""GPT-OSS family (OpenAI gpt-oss-20b / gpt-oss-120b): presets and Megatron-Core's options for every piece.

Every layer: grouped-query attention with biases on q/k/v and the output projection, one learnable attention sink per
head (Megatron-Core's `softmax_type="learnable"`: a logit added to each softmax row, dropped after it), alternating
windowed (layers 1, 3, ...: transformers' `sliding_attention`, window 128 = the token and the 127 before it) and
full layers (`window_attn_skip_freq=2`), YaRN RoPE (factor 32 over 4,096 positions, theta 150,000, correction
range not rounded: HF `truncate=false`); an MoE MLP of top-4 routed experts behind a linear router with a bias
(softmax over the top-k logits), each expert a clamped SwiGLU with biases: `(clamp(up, ±7) + 1) ·
quick_gelu(min(gate, 7))` with quick_gelu(x) = x·sigmoid(1.702x) (Megatron-Core's `quick_gelu`,
`glu_linear_offset=1`, `activation_func_clamp_value=7`). Biases everywhere are Megatron-Core's `add_bias_linear`,
which (0.16.1–0.19) needs expert tensor parallelism 1. RMSNorm (eps 1e-5), untied embeddings, vocabulary 201,088.

Shapes follow the released config.json files (gpt-oss-20b: 24 layers, 32 experts; gpt-oss-120b: 36 layers,
128 experts; both hidden 2,880, expert FFN 2,880, 64 heads of 64, 8 KV groups). Routing: the presets leave load
balancing off as Megatron-Bridge's GPT-OSS provider does (`moe_router_load_balancing_type: none`); `tiny_gpt_oss`
keeps a small aux loss so the layouts exercise the router loss. Parameter names are Megatron-Core's (the sink:
`decoder.layers.<i>.self_attention.core_attention.softmax_offset`, split over TP by heads).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from model_providers.core.family import Family, require, shape
from model_providers.core.mapping import (
    QKV,
    ConversionError,
    Copy,
    LayerExperts,
    LayerExpertsGateUp,
    LayerExpertsTransposed,
    Vocab,
)
from model_providers.core.windows import layer_windowed
from model_providers.core.yarn import refuse as _refuse
from model_providers.core.yarn import yarn_fields

# What makes a model a GPT-OSS (checked on export, set on import).
_FIXED = {"normalization": "RMSNorm", "gated_linear_unit": True, "activation": "quick_gelu",
          "glu_linear_offset": 1.0, "position_embedding_type": "yarn", "add_bias_linear": True, "add_qkv_bias": True,
          "qk_layernorm": False, "softmax_type": "learnable", "moe_router_score_function": "softmax",
          "moe_router_pre_softmax": False}
_COMMON = {"family": "gpt_oss", **_FIXED, "window_attn_skip_freq": 2, "share_embeddings_and_output_weights": False,
           "activation_func_clamp_value": 7.0, "layernorm_epsilon": 1e-5,
           "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.02, "rotary_base": 150000.0,
           "rotary_scaling_factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0, "yarn_correction_range_round_to_int": False,
           "sliding_window": 128, "kv_channels": 64, "moe_router_topk": 4, "moe_ffn_hidden_size": 2880,
           "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.9, "vocab_size": 201088,
           "seq_length": 4096, "max_position_embeddings": 131072}

PRESETS: dict[str, dict] = {
    # CPU-sized GPT-OSS: every piece of the real one; window 8 < seq_length 32 (layers 1, 3 windowed, 2, 4 full),
    # 8 heads / 4 groups of 16 (TP2 × CP2 a2a divides them), 4 experts of 64, top-2, YaRN over 16 positions.
    "tiny_gpt_oss": shape(_COMMON, 4, 64, 64, 8, 4, kv_channels=16, moe_ffn_hidden_size=64, num_moe_experts=4,
                          moe_router_topk=2, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                          sliding_window=8, seq_length=32, original_max_position_embeddings=16,
                          rotary_scaling_factor=4.0, max_position_embeddings=64, vocab_size=None),
    # gpt-oss-20b: 20.9B parameters, 3.6B active per token.
    "gpt_oss_20b": shape(_COMMON, 24, 2880, 2880, 64, 8, num_moe_experts=32),
    # gpt-oss-120b: 116.8B parameters, 5.1B active per token.
    "gpt_oss_120b": shape(_COMMON, 36, 2880, 2880, 64, 8, num_moe_experts=128),
}


_L = "model.layers.{i}."
_M = "decoder.layers."
_E = "decoder.layers.mlp.experts.experts."  # Megatron's expert weights: [layers, experts, ...]
# HF GptOssForCausalLM ↔ Megatron. Experts: HF holds a layer's experts in one tensor each (`gate_up_proj`
# [experts, hidden, 2·ffn] with gate/up interleaved, `down_proj` [experts, ffn, hidden], their biases), converted one
# layer at a time (`LayerExperts*`); released checkpoints store the two weights as MXFP4 (`pretrain/hf/mxfp4.py`).
MAPPING = (
    Vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    Copy(_M + "self_attention.linear_qkv.layer_norm_weight", _L + "input_layernorm.weight"),
    QKV(_M + "self_attention.linear_qkv.weight",
        (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight")),
    QKV(_M + "self_attention.linear_qkv.bias",
        (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias")),
    Copy(_M + "self_attention.linear_proj.weight", _L + "self_attn.o_proj.weight"),
    Copy(_M + "self_attention.linear_proj.bias", _L + "self_attn.o_proj.bias"),
    Copy(_M + "self_attention.core_attention.softmax_offset", _L + "self_attn.sinks"),
    Copy(_M + "pre_mlp_layernorm.weight", _L + "post_attention_layernorm.weight"),
    Copy(_M + "mlp.router.weight", _L + "mlp.router.weight"),
    Copy(_M + "mlp.router.bias", _L + "mlp.router.bias"),
    LayerExpertsGateUp(_E + "linear_fc1.weight", _L + "mlp.experts.gate_up_proj"),
    LayerExpertsGateUp(_E + "linear_fc1.bias", _L + "mlp.experts.gate_up_proj_bias"),
    LayerExpertsTransposed(_E + "linear_fc2.weight", _L + "mlp.experts.down_proj"),
    LayerExperts(_E + "linear_fc2.bias", _L + "mlp.experts.down_proj_bias"),
    Copy("decoder.final_layernorm.weight", "model.norm.weight"),
    Vocab("output_layer.weight", "lm_head.weight"),
)
QUICK_GELU_ALPHA = 1.702  # Megatron-Core's quick_gelu: x·sigmoid(1.702x), HF swiglu_alpha


class GptOssFamily(Family):
    """GptOssForCausalLM both ways. Every `GptOssConfig` field is mapped or refused (docs/hf.md "GPT-OSS"):

    num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size,
    max_position_embeddings, rms_norm_eps, attention_dropout, tie_word_embeddings: the model fields of those names
    (num_layers, num_query_groups, kv_channels, layernorm_epsilon, share_embeddings_and_output_weights);
    num_local_experts, num_experts_per_tok, intermediate_size: num_moe_experts, moe_router_topk,
    moe_ffn_hidden_size; sliding_window + layer_types: sliding_window + window_attn_skip_freq (2 when odd layers are
    windowed, None when all are, else a 0/1 list); rope_parameters: YaRN only (rope_theta, factor,
    original_max_position_embeddings, beta_fast, beta_slow, truncate = not yarn_correction_range_round_to_int,
    mscale/mscale_all_dim; attention_factor only as derived; partial_rotary_factor 1); swiglu_limit:
    activation_func_clamp_value; swiglu_alpha: 1.702 only (quick_gelu's constant); attention_bias: true only
    (add_bias_linear covers attention, router and experts together); router_aux_loss_coef: moe_aux_loss_coeff, with
    output_router_logits = load balancing (true: aux_loss, false: none, as transformers adds the loss only then).
    hidden_act is not read by transformers' GptOss (the experts' activation is the clamped SwiGLU) and is written
    as the released "silu"; initializer_range, use_cache, token ids and unknown keys come from the imported
    config.json. `quantization_config` (MXFP4) is read by the import (`pretrain/hf/mxfp4.py`), never exported.
    """

    config_class: ClassVar[str] = "GptOssConfig"

    def to_hf_config(self, m: Any, vocab: int, *, bos: int | None, eos: int | None, dtype: Any,
                     base: Mapping | None = None) -> Any:
        import transformers

        self.require_fixed_fields(m)
        require(m, "rotary_percent", 1.0, self.hf_architecture)
        for key, value in (("moe_layer_freq", 1), ("moe_shared_expert_intermediate_size", None),
                           ("moe_router_topk_scaling_factor", None), ("moe_router_enable_expert_bias", False),
                           ("moe_router_num_groups", None), ("mtp_num_layers", None), ("qk_layernorm", False)):
            require(m, key, value, self.hf_architecture)
        if m.moe_router_load_balancing_type not in ("aux_loss", "none"):
            raise ConversionError(f"model.moe_router_load_balancing_type={m.moe_router_load_balancing_type!r} "
                                  f"cannot be expressed as {self.hf_architecture} (aux_loss or none)")
        heads = m.num_attention_heads
        ffn = m.moe_ffn_hidden_size or m.ffn_hidden_size
        windowed = [layer_windowed(m.window_attn_skip_freq, i + 1) and m.sliding_window is not None
                    for i in range(m.num_layers)]
        arch = dict(
            vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=ffn, num_hidden_layers=m.num_layers,
            num_attention_heads=heads, num_key_value_heads=m.num_query_groups or heads,
            head_dim=m.kv_channels or m.hidden_size // heads, num_local_experts=m.num_moe_experts,
            num_experts_per_tok=m.moe_router_topk, max_position_embeddings=m.max_position_embeddings or m.seq_length,
            rms_norm_eps=m.layernorm_epsilon, rope_parameters=_rope_parameters(m),
            attention_dropout=m.attention_dropout, tie_word_embeddings=m.share_embeddings_and_output_weights,
            sliding_window=m.sliding_window,
            layer_types=["sliding_attention" if w else "full_attention" for w in windowed],
            swiglu_alpha=QUICK_GELU_ALPHA, swiglu_limit=_limit(m), router_aux_loss_coef=m.moe_aux_loss_coeff,
            output_router_logits=m.moe_router_load_balancing_type == "aux_loss", attention_bias=True,
            architectures=[self.hf_architecture], dtype=str(dtype).removeprefix("torch."),
        )
        kept = {k: v for k, v in (base or {}).items() if k in ("hidden_act",)}
        return self.hf_config(getattr(transformers, self.config_class), {"hidden_act": "silu", **kept, **arch},
                              bos=bos, eos=eos, base=base)

    def from_hf_config(self, hf: Any) -> dict:
        _refuse(hf, "attention_bias", bool(hf.attention_bias), "GPT-OSS's experts and router have biases, and "
                "Megatron-Core's add_bias_linear covers them and the attention's together")
        _refuse(hf, "swiglu_alpha", math.isclose(float(hf.swiglu_alpha), QUICK_GELU_ALPHA),
                f"Megatron-Core's quick_gelu has the fixed gain {QUICK_GELU_ALPHA}")
        types = list(hf.layer_types)
        bad = sorted(set(types) - {"sliding_attention", "full_attention"})
        _refuse(hf, "layer_types", not bad, f"unknown layer types {bad}")
        pattern = [int(t == "sliding_attention") for t in types]
        window = hf.sliding_window if any(pattern) else None
        if window is None:
            freq = None
        elif all(pattern):
            freq = None
        elif pattern == [int(layer_windowed(2, i + 1)) for i in range(len(pattern))]:
            freq = 2
        else:
            freq = pattern
        heads = hf.num_attention_heads
        context = int(hf.max_position_embeddings)
        limit = hf.swiglu_limit
        return {
            **self.fixed_fields, "family": self.name, "num_layers": hf.num_hidden_layers,
            "hidden_size": hf.hidden_size, "ffn_hidden_size": hf.intermediate_size,
            "moe_ffn_hidden_size": hf.intermediate_size, "num_attention_heads": heads,
            "num_query_groups": hf.num_key_value_heads or heads,
            "kv_channels": hf.head_dim if hf.head_dim * heads != hf.hidden_size else None,
            "layernorm_epsilon": float(hf.rms_norm_eps), **_rope_fields(hf), "rope_scaling": False,
            "share_embeddings_and_output_weights": bool(hf.tie_word_embeddings), "vocab_size": hf.vocab_size,
            "max_position_embeddings": context, "seq_length": min(context, 4096),
            "sliding_window": int(window) if window is not None else None, "window_attn_skip_freq": freq,
            "activation_func_clamp_value": float(limit) if limit is not None else None,
            "num_moe_experts": hf.num_local_experts, "moe_router_topk": hf.num_experts_per_tok,
            "moe_aux_loss_coeff": float(hf.router_aux_loss_coef),
            "moe_router_load_balancing_type": "aux_loss" if hf.output_router_logits else "none",
            "hidden_dropout": 0.0, "attention_dropout": float(hf.attention_dropout or 0.0),
        }

    def config_json(self, hf_cfg: Any) -> dict:
        """The transformers config plus the released `rope_theta`/`rope_scaling` keys."""
        out = hf_cfg.to_diff_dict()
        rope = out.get("rope_parameters")
        if isinstance(rope, dict):
            out["rope_theta"] = rope["rope_theta"]
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        return out


def _limit(m: Any) -> float | None:
    return float(m.activation_func_clamp_value) if m.activation_func_clamp_value is not None else None


def _rope_parameters(m: Any) -> dict:
    """transformers' YaRN `rope_parameters` for our fields (mscale/mscale_all_dim written only when they change the
    attention factor transformers derives from the factor alone)."""
    rope = {"rope_type": "yarn", "rope_theta": float(m.rotary_base), "factor": float(m.rotary_scaling_factor),
            "beta_fast": float(m.beta_fast), "beta_slow": float(m.beta_slow),
            "truncate": bool(m.yarn_correction_range_round_to_int),
            "original_max_position_embeddings": int(m.original_max_position_embeddings)}
    if (m.mscale, m.mscale_all_dim) != (1.0, 0.0):
        if not (m.mscale and m.mscale_all_dim):
            raise ConversionError(f"model.mscale={m.mscale} with model.mscale_all_dim={m.mscale_all_dim} cannot be "
                                  "expressed as GptOssForCausalLM (transformers needs both or neither)")
        rope.update(mscale=float(m.mscale), mscale_all_dim=float(m.mscale_all_dim))
    return rope


def _rope_fields(hf: Any) -> dict:
    """Our YaRN fields of a GptOssConfig (ConversionError naming what Megatron-Core's YaRN cannot compute)."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype != "yarn":
        raise ConversionError(f"config.json: rope_scaling type {rtype!r} is not supported (GPT-OSS: yarn)")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError(f"config.json: rope_scaling.partial_rotary_factor={rope['partial_rotary_factor']} is "
                              "not supported (RoPE on the whole head only)")
    return {"rotary_base": float(rope.get("rope_theta", 150000.0)), "rotary_percent": 1.0,
            **yarn_fields(hf, rope, keep_mscale_all_dim=False),
            "yarn_correction_range_round_to_int": bool(rope.get("truncate", True))}


FAMILY = GptOssFamily(name="gpt_oss", hf_architecture="GptOssForCausalLM", hf_model_type="gpt_oss",
                      presets=PRESETS, mapping=MAPPING, fixed_fields=_FIXED,
                      hf_ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",))
