"""GPT family (GPT-2/GPT-3 style: LayerNorm, GELU, biases, learned positions, tied embeddings):
presets and the HuggingFace mapping table."""

from __future__ import annotations

FAMILY = "gpt"
HF_ARCHITECTURE = "GPT2LMHeadModel"

_GPT_COMMON = {
    "family": "gpt",
    "normalization": "LayerNorm",
    "gated_linear_unit": False,
    "activation": "gelu",
    "position_embedding_type": "learned_absolute",
    "share_embeddings_and_output_weights": True,
    "add_bias_linear": True,
    "add_qkv_bias": True,
    "layernorm_epsilon": 1e-5,
}

PRESETS: dict[str, dict] = {
    "tiny_gpt": {
        **_GPT_COMMON,
        "num_layers": 4,
        "hidden_size": 128,
        "ffn_hidden_size": 512,
        "num_attention_heads": 8,
        "seq_length": 128,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    },
    "gpt2_small": {
        **_GPT_COMMON,
        "num_layers": 12,
        "hidden_size": 768,
        "ffn_hidden_size": 3072,
        "num_attention_heads": 12,
        "seq_length": 1024,
        "vocab_size": 50257,
    },
    "gpt2_medium": {
        **_GPT_COMMON,
        "num_layers": 24,
        "hidden_size": 1024,
        "ffn_hidden_size": 4096,
        "num_attention_heads": 16,
        "seq_length": 1024,
        "vocab_size": 50257,
    },
    "gpt3_1p3b": {
        **_GPT_COMMON,
        "num_layers": 24,
        "hidden_size": 2048,
        "ffn_hidden_size": 8192,
        "num_attention_heads": 16,
        "seq_length": 2048,
        "vocab_size": 50257,
    },
}

# HuggingFace mapping to GPT2LMHeadModel (see llama.py for the row format). GPT-2's Conv1D stores
# weights as [in, out], hence `transpose`; its fused c_attn is [q; k; v] over all heads, while
# Megatron's linear_qkv is [q; k; v] per head: `fused_qkv` / `fused_qkv_bias` regroup and transpose.
_H = "transformer.h.{i}."
_M = "decoder.layers."
HF_MAPPING: tuple[tuple[str, str | tuple[str, ...], str], ...] = (
    ("embedding.word_embeddings.weight", "transformer.wte.weight", "vocab"),
    ("embedding.position_embeddings.weight", "transformer.wpe.weight", "copy"),
    (_M + "self_attention.linear_qkv.layer_norm_weight", _H + "ln_1.weight", "copy"),
    (_M + "self_attention.linear_qkv.layer_norm_bias", _H + "ln_1.bias", "copy"),
    (_M + "self_attention.linear_qkv.weight", _H + "attn.c_attn.weight", "fused_qkv"),
    (_M + "self_attention.linear_qkv.bias", _H + "attn.c_attn.bias", "fused_qkv_bias"),
    (_M + "self_attention.linear_proj.weight", _H + "attn.c_proj.weight", "transpose"),
    (_M + "self_attention.linear_proj.bias", _H + "attn.c_proj.bias", "copy"),
    (_M + "mlp.linear_fc1.layer_norm_weight", _H + "ln_2.weight", "copy"),
    (_M + "mlp.linear_fc1.layer_norm_bias", _H + "ln_2.bias", "copy"),
    (_M + "mlp.linear_fc1.weight", _H + "mlp.c_fc.weight", "transpose"),
    (_M + "mlp.linear_fc1.bias", _H + "mlp.c_fc.bias", "copy"),
    (_M + "mlp.linear_fc2.weight", _H + "mlp.c_proj.weight", "transpose"),
    (_M + "mlp.linear_fc2.bias", _H + "mlp.c_proj.bias", "copy"),
    ("decoder.final_layernorm.weight", "transformer.ln_f.weight", "copy"),
    ("decoder.final_layernorm.bias", "transformer.ln_f.bias", "copy"),
    ("output_layer.weight", "lm_head.weight", "vocab"),
)
# Causal-mask buffers older GPT-2 checkpoints carry; skipped on import.
HF_IGNORED: tuple[str, ...] = (r"transformer\.h\.\d+\.attn\.(masked_)?bias",)
