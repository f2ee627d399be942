"""Llama family (Llama-2, Llama-3, 3.1, 3.2): presets, the HuggingFace mapping and config both ways.

`LlamaFamily` is also the base of the families built like Llama (RMSNorm, SwiGLU, RoPE, GQA): Mistral, Qwen2,
Qwen3 subclass it and change only what differs (config class, biases, QK-norm, sliding window).
Shapes follow the public model configs.
"""

from __future__ import annotations

from typing import Any, ClassVar

from model_providers.core.family import Family, require
from model_providers.core.mapping import QKV, ConversionError, Copy, GateUp, Vocab

# What makes a model a Llama (checked on export, set on import).
_FIXED = {"normalization": "RMSNorm", "gated_linear_unit": True, "activation": "silu",
          "position_embedding_type": "rope", "add_bias_linear": False, "add_qkv_bias": False,
          "qk_layernorm": False}
_LLAMA_COMMON = {"family": "llama", **_FIXED, "share_embeddings_and_output_weights": False, "hidden_dropout": 0.0,
                 "attention_dropout": 0.0}

_LLAMA3 = {**_LLAMA_COMMON, "rotary_base": 500000.0, "layernorm_epsilon": 1e-5, "vocab_size": 128256,
           "max_position_embeddings": 8192}
# Llama-3.1/3.2: Llama-3 RoPE frequency scaling; 3.1 with factor 8, 3.2 with factor 32 (low 1, high 4, 8192).
_LLAMA31_ROPE = {"rope_scaling": True, "rope_scaling_factor": 8.0, "rope_scaling_low_freq_factor": 1.0,
                 "rope_scaling_high_freq_factor": 4.0, "rope_scaling_original_max_position_embeddings": 8192,
                 "max_position_embeddings": 131072}
_LLAMA32 = {**_LLAMA3, **_LLAMA31_ROPE, "rope_scaling_factor": 32.0, "share_embeddings_and_output_weights": True,
            "seq_length": 8192}

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
        "max_position_embeddings": 4096,
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
        **_LLAMA31_ROPE,
        "num_layers": 126,
        "hidden_size": 16384,
        "ffn_hidden_size": 53248,
        "num_attention_heads": 128,
        "num_query_groups": 8,
        "seq_length": 8192,
    },
    # Llama-3.2 text models: tied embeddings, head_dim 64 (1B) / 128 (3B).
    "llama32_1b": {**_LLAMA32, "num_layers": 16, "hidden_size": 2048, "ffn_hidden_size": 8192,
                   "num_attention_heads": 32, "num_query_groups": 8},
    "llama32_3b": {**_LLAMA32, "num_layers": 28, "hidden_size": 3072, "ffn_hidden_size": 8192,
                   "num_attention_heads": 24, "num_query_groups": 8},
}
PRESETS["llama31_8b"] = {**PRESETS["llama3_8b"], **_LLAMA31_ROPE}
PRESETS["llama31_70b"] = {**PRESETS["llama3_70b"], **_LLAMA31_ROPE}
PRESETS["llama3_405b"] = PRESETS["llama31_405b"]  # Llama-3 405B was only released as 3.1

_L = "model.layers.{i}."
_M = "decoder.layers."
# The Llama table; the families built like Llama add rows to it (biases, QK-norm).
MAPPING = (
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
)
QKV_BIAS = QKV(_M + "self_attention.linear_qkv.bias",
               (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"))
QK_NORM = (Copy(_M + "self_attention.q_layernorm.weight", _L + "self_attn.q_norm.weight"),
           Copy(_M + "self_attention.k_layernorm.weight", _L + "self_attn.k_norm.weight"))
ROTARY_BUFFERS = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

# Llama-3 RoPE scaling: config.json `rope_scaling` key ↔ our model field.
_LLAMA3_ROPE_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_low_freq_factor",
                     "high_freq_factor": "rope_scaling_high_freq_factor",
                     "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings"}


def rope_parameters(m: Any) -> dict:
    """transformers' `rope_parameters` for our RoPE fields."""
    rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if m.rope_scaling:
        rope["rope_type"] = "llama3"
        for hf_key, field in _LLAMA3_ROPE_KEYS.items():
            value = getattr(m, field)
            rope[hf_key] = int(value) if hf_key == "original_max_position_embeddings" else float(value)
    return rope


def rope_fields(hf: Any) -> dict:
    """Our RoPE fields for a transformers config (ConversionError for RoPE variants we cannot run)."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rtype = rope.get("rope_type", "default")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError(f"config.json: partial_rotary_factor={rope['partial_rotary_factor']} is not supported "
                              "(RoPE on the whole head only)")
    fields: dict[str, Any] = {"rotary_base": float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
                              "rope_scaling": False}
    if rtype == "llama3":
        fields["rope_scaling"] = True
        for hf_key, field in _LLAMA3_ROPE_KEYS.items():
            if rope.get(hf_key) is None:
                raise ConversionError(f"config.json: rope_scaling.{hf_key} is missing (needed by rope_type 'llama3')")
            fields[field] = int(rope[hf_key]) if hf_key == "original_max_position_embeddings" else float(rope[hf_key])
    elif rtype != "default":
        raise ConversionError(f"config.json: rope_scaling type {rtype!r} is not supported (supported: default, "
                              "llama3)")
    return fields


class LlamaFamily(Family):
    """LlamaForCausalLM: RMSNorm, SwiGLU, RoPE (optionally Llama-3 scaled), GQA, no biases.

    Subclasses (families built like Llama) set `config_class` and override `hf_extra` / `fields_from_hf`.
    """

    config_class: ClassVar[str] = "LlamaConfig"  # the transformers config class
    has_head_dim: ClassVar[bool] = True  # the config class has a `head_dim` field (else written only if needed)

    def hf_extra(self, m: Any) -> dict:
        """Family-specific transformers config kwargs (raise ConversionError for what the class cannot hold)."""
        require(m, "sliding_window", None, self.hf_architecture)
        require(m, "window_attn_skip_freq", None, self.hf_architecture)
        return {"attention_bias": False, "mlp_bias": False}

    def fields_from_hf(self, hf: Any) -> dict:
        """Family-specific model fields of a transformers config (raise ConversionError for what we cannot run)."""
        if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
            raise ConversionError(f"config.json: attention_bias/mlp_bias are not supported for the {self.name} family")
        return {}

    def to_hf_config(self, m: Any, vocab: int, *, bos: int | None, eos: int | None, dtype: Any,
                     base: Any = None) -> Any:
        import transformers

        self.require_fixed_fields(m)
        require(m, "rotary_percent", 1.0, "a transformers model")
        heads = m.num_attention_heads
        arch = dict(
            vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size or 4 * m.hidden_size,
            num_hidden_layers=m.num_layers, num_attention_heads=heads, num_key_value_heads=m.num_query_groups or heads,
            hidden_act="silu", max_position_embeddings=m.max_position_embeddings or m.seq_length,
            rms_norm_eps=m.layernorm_epsilon, rope_parameters=rope_parameters(m), attention_dropout=m.attention_dropout,
            tie_word_embeddings=m.share_embeddings_and_output_weights, architectures=[self.hf_architecture],
            dtype=str(dtype).removeprefix("torch."), **self.hf_extra(m),
        )
        if self.has_head_dim or m.kv_channels:
            arch["head_dim"] = m.kv_channels or m.hidden_size // heads
        return self.hf_config(getattr(transformers, self.config_class), arch, bos=bos, eos=eos, base=base)

    def config_json(self, hf_cfg: Any) -> dict:
        """The transformers config plus the pre-v5 `rope_theta`/`rope_scaling` keys."""
        out = hf_cfg.to_diff_dict()
        rope = out.get("rope_parameters")
        if isinstance(rope, dict):
            out["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type") == "llama3":
                out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        return out

    def from_hf_config(self, hf: Any) -> dict:
        if hf.hidden_act != "silu":
            raise ConversionError(f"config.json: hidden_act={hf.hidden_act!r}; only 'silu' (SwiGLU) is supported")
        extra = self.fields_from_hf(hf)
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        context = int(hf.max_position_embeddings)
        return {
            **self.fixed_fields, "family": self.name,
            "num_layers": hf.num_hidden_layers, "hidden_size": hf.hidden_size,
            "ffn_hidden_size": hf.intermediate_size, "num_attention_heads": heads,
            "num_query_groups": hf.num_key_value_heads or heads,
            "kv_channels": head_dim if head_dim * heads != hf.hidden_size else None,
            "layernorm_epsilon": float(hf.rms_norm_eps), **rope_fields(hf),
            "share_embeddings_and_output_weights": bool(hf.tie_word_embeddings), "vocab_size": hf.vocab_size,
            # The model's context length; the training length (a training setting) defaults to at most 4096.
            "max_position_embeddings": context, "seq_length": min(context, 4096), "sliding_window": None,
            "hidden_dropout": 0.0, "attention_dropout": float(getattr(hf, "attention_dropout", 0.0)), **extra,
        }


def llama_like(cls: type[LlamaFamily], name: str, hf_architecture: str, presets: dict, fixed_fields: dict,
               mapping: tuple = MAPPING) -> LlamaFamily:
    """A family built like Llama: transformers' `model_type` is its name; rotary buffers are not weights."""
    return cls(name=name, hf_architecture=hf_architecture, hf_model_type=name, presets=presets,
               fixed_fields=fixed_fields, mapping=mapping, hf_ignored=ROTARY_BUFFERS)


FAMILY = llama_like(LlamaFamily, "llama", "LlamaForCausalLM", PRESETS, _FIXED)
