"""Mixtral family (sparse Mixture of Experts on a Mistral/Llama body): presets, the HF mapping, config both ways.

Every layer's MLP is `num_moe_experts` SwiGLU experts of size `ffn_hidden_size` (HF `intermediate_size`) behind a
linear router; each token goes to its top-k experts with softmax weights renormalised over those k (Megatron's
softmax over the top-k logits is the same function). The `tiny_moe` preset is the CPU-sized shape the tests and
`pretrain/configs/tiny_moe.yaml` train with expert parallelism. Shapes follow the public model configs.
"""

from __future__ import annotations

import sys
from typing import Any

from model_providers.core.family import Family, require
from model_providers.core.mapping import QKV, ConversionError, Copy, GateUp, Vocab

# What makes a model a Mixtral (checked on export, set on import).
_FIXED = {"normalization": "RMSNorm", "gated_linear_unit": True, "activation": "silu",
          "position_embedding_type": "rope", "add_bias_linear": False, "add_qkv_bias": False,
          "qk_layernorm": False, "moe_router_score_function": "softmax", "moe_router_pre_softmax": False}
_COMMON = {"family": "mixtral", **_FIXED, "share_embeddings_and_output_weights": False, "hidden_dropout": 0.0,
           "attention_dropout": 0.0, "layernorm_epsilon": 1e-5, "moe_router_topk": 2,
           "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.02}

PRESETS: dict[str, dict] = {
    # CPU-sized MoE: tiny_llama's attention (GQA 8 heads / 4 groups) with 8 SwiGLU experts, top-2 routing.
    "tiny_moe": {**_COMMON, "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 128, "num_attention_heads": 8,
                 "num_query_groups": 4, "seq_length": 128, "rotary_base": 10000.0, "num_moe_experts": 8},
    # Mixtral-8x7B-v0.1: 46.7B parameters, 12.9B active per token.
    "mixtral_8x7b": {**_COMMON, "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
                     "num_attention_heads": 32, "num_query_groups": 8, "seq_length": 4096, "rotary_base": 1e6,
                     "vocab_size": 32000, "num_moe_experts": 8},
}

_L = "model.layers.{i}."
_E = _L + "block_sparse_moe.experts.{e}."
_M = "decoder.layers."
_X = "decoder.layers.mlp.experts.experts."  # Megatron's expert weights: [layers, experts, ...]

# The body every Llama-like MoE shares (attention, norms, embeddings); the MLP rows are per family.
ATTENTION_AND_EMBEDDINGS = (
    Vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    Copy(_M + "self_attention.linear_qkv.layer_norm_weight", _L + "input_layernorm.weight"),
    QKV(_M + "self_attention.linear_qkv.weight",
        (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight")),
    Copy(_M + "self_attention.linear_proj.weight", _L + "self_attn.o_proj.weight"),
    Copy(_M + "pre_mlp_layernorm.weight", _L + "post_attention_layernorm.weight"),
    Copy("decoder.final_layernorm.weight", "model.norm.weight"),
    Vocab("output_layer.weight", "lm_head.weight"),
)


def rope_theta(cfg: Any) -> float:
    """RoPE base of a transformers config (v5 `rope_parameters`, else `rope_theta`); only plain RoPE."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ConversionError(f"config.json: rope type {rope['rope_type']!r} is not supported (default only)")
    return float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def common_fields(family: Family, cfg: Any) -> dict:
    """Our `model.*` fields shared by Llama-like MoE configs (attention, norms, embeddings, routing)."""
    if cfg.hidden_act != "silu":
        raise ConversionError(f"config.json: hidden_act={cfg.hidden_act!r}; only 'silu' (SwiGLU) is supported")
    if getattr(cfg, "attention_bias", False):
        raise ConversionError(f"config.json: attention_bias=true is not supported for the {family.name} family")
    seq = min(int(cfg.max_position_embeddings), 4096)
    window = getattr(cfg, "sliding_window", None)
    if window is not None and window < seq:
        raise ConversionError(f"config.json: sliding_window={window} is not supported (full causal attention only)")
    if float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0) > 0:
        print(f"[convert] warning: HF router_jitter_noise={cfg.router_jitter_noise} is not used by Megatron "
              "training here", file=sys.stderr)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {
        **family.fixed_fields, "family": family.name,
        "num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "ffn_hidden_size": cfg.intermediate_size,
        "num_attention_heads": heads, "num_query_groups": cfg.num_key_value_heads or heads,
        "kv_channels": head_dim if head_dim * heads != cfg.hidden_size else None,
        "layernorm_epsilon": float(cfg.rms_norm_eps), "rotary_base": rope_theta(cfg), "rope_scaling": False,
        "share_embeddings_and_output_weights": bool(cfg.tie_word_embeddings), "vocab_size": cfg.vocab_size,
        "seq_length": seq, "hidden_dropout": 0.0, "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0)),
        "num_moe_experts": cfg.num_local_experts, "moe_router_topk": cfg.num_experts_per_tok,
        "moe_aux_loss_coeff": float(cfg.router_aux_loss_coef), "moe_router_load_balancing_type": "aux_loss",
    }


def common_hf_kwargs(m: Any, vocab: int, *, bos: int | None, eos: int | None, dtype: Any, arch: str) -> dict:
    """transformers config kwargs shared by Llama-like MoE configs."""
    require(m, "rotary_percent", 1.0, "a transformers model")
    require(m, "rope_scaling", False, arch)
    heads = m.num_attention_heads
    return dict(
        vocab_size=vocab, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers, num_attention_heads=heads,
        num_key_value_heads=m.num_query_groups or heads, head_dim=m.kv_channels or m.hidden_size // heads,
        hidden_act="silu", max_position_embeddings=m.seq_length, rms_norm_eps=m.layernorm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
        attention_dropout=m.attention_dropout, tie_word_embeddings=m.share_embeddings_and_output_weights,
        num_experts_per_tok=m.moe_router_topk, router_aux_loss_coef=m.moe_aux_loss_coeff,
        bos_token_id=bos, eos_token_id=eos, architectures=[arch], dtype=str(dtype).removeprefix("torch."),
    )


def config_json_with_rope_theta(hf_cfg: Any) -> dict:
    """transformers' diff dict plus the pre-v5 `rope_theta` key (read by older loaders)."""
    out = hf_cfg.to_diff_dict()
    rope = out.get("rope_parameters")
    if isinstance(rope, dict):
        out["rope_theta"] = rope["rope_theta"]
    return out


class MixtralFamily(Family):
    """MixtralForCausalLM: Mistral attention (GQA, RoPE, RMSNorm) with top-k routed SwiGLU experts."""

    def to_hf_config(self, m: Any, vocab: int, *, bos: int | None, eos: int | None, dtype: Any) -> Any:
        from transformers import MixtralConfig

        self.require_fixed_fields(m)
        if m.num_moe_experts is None:
            raise ConversionError("model.num_moe_experts is null: a MixtralForCausalLM needs experts")
        ffn = m.ffn_hidden_size or 4 * m.hidden_size
        if (m.moe_ffn_hidden_size or ffn) != ffn:
            raise ConversionError(f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} differs from "
                                  f"model.ffn_hidden_size={ffn}: MixtralForCausalLM has one FFN size")
        return MixtralConfig(
            **common_hf_kwargs(m, vocab, bos=bos, eos=eos, dtype=dtype, arch=self.hf_architecture),
            intermediate_size=ffn, num_local_experts=m.num_moe_experts,
            sliding_window=None, router_jitter_noise=0.0,
        )

    def config_json(self, hf_cfg: Any) -> dict:
        return config_json_with_rope_theta(hf_cfg)

    def from_hf_config(self, cfg: Any) -> dict:
        return common_fields(self, cfg)


FAMILY = MixtralFamily(
    name="mixtral",
    hf_architecture="MixtralForCausalLM",
    hf_model_type="mixtral",
    presets=PRESETS,
    fixed_fields=_FIXED,
    mapping=(
        *ATTENTION_AND_EMBEDDINGS,
        Copy(_M + "mlp.router.weight", _L + "block_sparse_moe.gate.weight"),
        GateUp(_X + "linear_fc1.weight", (_E + "w1.weight", _E + "w3.weight")),
        Copy(_X + "linear_fc2.weight", _E + "w2.weight"),
    ),
    hf_ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
)
