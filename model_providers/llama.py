"""Llama family (Llama-2, Llama-3, Llama-3.1): presets, the HuggingFace mapping and config both ways.

Shapes follow the public model configs. Llama-3.1 shapes use Llama-3 RoPE frequency scaling
(factor 8, original context 8192).
"""

from __future__ import annotations

from typing import Any

from model_providers.core.family import Family, require
from model_providers.core.mapping import QKV, ConversionError, Copy, GateUp, Vocab

# What makes a model a Llama (checked on export, set on import).
_FIXED = {"normalization": "RMSNorm", "gated_linear_unit": True, "activation": "silu",
          "position_embedding_type": "rope", "add_bias_linear": False, "add_qkv_bias": False}
_LLAMA_COMMON = {"family": "llama", **_FIXED, "share_embeddings_and_output_weights": False, "hidden_dropout": 0.0,
                 "attention_dropout": 0.0}

_LLAMA3 = {**_LLAMA_COMMON, "rotary_base": 500000.0, "layernorm_epsilon": 1e-5, "vocab_size": 128256}

PRESETS: dict[str, dict] = {
    # CPU-sized Llama shape: GQA (8 heads, 4 groups), RMSNorm, SwiGLU, RoPE, untied embeddings.
    "tiny_llama": {
        **_LLAMA_COMMON,
        "num_layers": 4,
        "hidden_size": 128,
        "ffn_hidden_size": 352,
        "num_attention_heads": 8,
        "num_query_groups": 4,
        "seq_length": 128,
        "layernorm_epsilon": 1e-5,
        "rotary_base": 10000.0,
    },
    "llama2_7b": {
        **_LLAMA_COMMON,
        "num_layers": 32,
        "hidden_size": 4096,
        "ffn_hidden_size": 11008,
        "num_attention_heads": 32,
        "num_query_groups": 32,
        "seq_length": 4096,
        "layernorm_epsilon": 1e-5,
        "rotary_base": 10000.0,
        "vocab_size": 32000,
    },
    "llama3_8b": {
        **_LLAMA3,
        "num_layers": 32,
        "hidden_size": 4096,
        "ffn_hidden_size": 14336,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "seq_length": 8192,
    },
    "llama3_70b": {
        **_LLAMA3,
        "num_layers": 80,
        "hidden_size": 8192,
        "ffn_hidden_size": 28672,
        "num_attention_heads": 64,
        "num_query_groups": 8,
        "seq_length": 8192,
    },
    "llama31_405b": {
        **_LLAMA3,
        "num_layers": 126,
        "hidden_size": 16384,
        "ffn_hidden_size": 53248,
        "num_attention_heads": 128,
        "num_query_groups": 8,
        "seq_length": 8192,
        "rope_scaling": True,
        "rope_scaling_factor": 8.0,
    },
}
# Llama-3.1 = Llama-3 shapes with RoPE frequency scaling (factor 8, original context 8192).
_LLAMA31_ROPE = {"rope_scaling": True, "rope_scaling_factor": 8.0}
PRESETS["llama31_8b"] = {**PRESETS["llama3_8b"], **_LLAMA31_ROPE}
PRESETS["llama31_70b"] = {**PRESETS["llama3_70b"], **_LLAMA31_ROPE}
PRESETS["llama3_405b"] = PRESETS["llama31_405b"]  # Llama-3 405B was only released as 3.1

_L = "model.layers.{i}."
_M = "decoder.layers."
# Megatron-Core's Llama-3.1 RoPE scaling constants (RotaryEmbedding._apply_scaling defaults).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class LlamaFamily(Family):
    """LlamaForCausalLM: RMSNorm, SwiGLU, RoPE (optionally Llama-3 scaled), GQA, no biases."""

    def to_hf_config(self, m: Any, vocab: int, *, bos: int | None, eos: int | None, dtype: Any) -> Any:
        from transformers import LlamaConfig

        self.require_fixed_fields(m)
        require(m, "rotary_percent", 1.0, "a transformers model")
        heads = m.num_attention_heads
        rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
        max_pos = m.seq_length
        if m.rope_scaling:
            rope = {"rope_type": "llama3", "rope_theta": float(m.rotary_base), "factor": float(m.rope_scaling_factor),
                    **LLAMA3_ROPE}
            max_pos = max(m.seq_length, int(LLAMA3_ROPE["original_max_position_embeddings"] * m.rope_scaling_factor))
        return LlamaConfig(
            vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size or 4 * m.hidden_size,
            num_hidden_layers=m.num_layers, num_attention_heads=heads, num_key_value_heads=m.num_query_groups or heads,
            head_dim=m.kv_channels or m.hidden_size // heads, hidden_act="silu", max_position_embeddings=max_pos,
            rms_norm_eps=m.layernorm_epsilon, rope_parameters=rope, attention_bias=False, mlp_bias=False,
            attention_dropout=m.attention_dropout, tie_word_embeddings=m.share_embeddings_and_output_weights,
            bos_token_id=bos, eos_token_id=eos, architectures=[self.hf_architecture],
            dtype=str(dtype).removeprefix("torch."),
        )

    def config_json(self, hf_cfg: Any) -> dict:
        """The transformers config plus the pre-v5 `rope_theta`/`rope_scaling` keys."""
        out = hf_cfg.to_diff_dict()
        rope = out.get("rope_parameters")
        if isinstance(rope, dict):
            out["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type") == "llama3":
                out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        return out

    def from_hf_config(self, cfg: Any) -> dict:
        if cfg.hidden_act != "silu":
            raise ConversionError(f"config.json: hidden_act={cfg.hidden_act!r}; only 'silu' (SwiGLU) is supported")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise ConversionError("config.json: attention_bias/mlp_bias are not supported for the llama family")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        rtype = rope.get("rope_type", "default")
        fields = {}
        if rtype == "llama3":
            for key, want in LLAMA3_ROPE.items():
                if float(rope.get(key, want)) != float(want):
                    raise ConversionError(f"config.json: rope_scaling.{key}={rope.get(key)} (Megatron uses {want})")
            fields = {"rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
        elif rtype != "default":
            raise ConversionError(f"config.json: rope type {rtype!r} is not supported (default or llama3)")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return {
            **self.fixed_fields, "family": self.name,
            "num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "ffn_hidden_size": cfg.intermediate_size, "num_attention_heads": heads,
            "num_query_groups": cfg.num_key_value_heads or heads,
            "kv_channels": head_dim if head_dim * heads != cfg.hidden_size else None,
            "layernorm_epsilon": float(cfg.rms_norm_eps), "rotary_base": float(theta), "rope_scaling": False,
            "share_embeddings_and_output_weights": bool(cfg.tie_word_embeddings), "vocab_size": cfg.vocab_size,
            "seq_length": min(int(cfg.max_position_embeddings), 4096), "hidden_dropout": 0.0,
            "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0)), **fields,
        }


FAMILY = LlamaFamily(
    name="llama",
    hf_architecture="LlamaForCausalLM",
    hf_model_type="llama",
    presets=PRESETS,
    fixed_fields=_FIXED,
    mapping=(
        Vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        Copy(_M + "self_attention.linear_qkv.layer_norm_weight", _L + "input_layernorm.weight"),
        QKV(_M + "self_attention.linear_qkv.weight",
            (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight")),
        Copy(_M + "self_attention.linear_proj.weight", _L + "self_attn.o_proj.weight"),
        Copy(_M + "mlp.linear_fc1.layer_norm_weight", _L + "post_attention_layernorm.weight"),
        GateUp(_M + "mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight")),
        Copy(_M + "mlp.linear_fc2.weight", _L + "mlp.down_proj.weight"),
        Copy("decoder.final_layernorm.weight", "model.norm.weight"),
        Vocab("output_layer.weight", "lm_head.weight"),
    ),
    hf_ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
)
