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
