"""Llama family (Llama-2, Llama-3, Llama-3.1): presets and the HuggingFace mapping table.

Shapes follow the public model configs. Llama-3.1 shapes use Llama-3 RoPE frequency scaling
(factor 8, original context 8192).
"""

from __future__ import annotations

FAMILY = "llama"
HF_ARCHITECTURE = "LlamaForCausalLM"

_LLAMA_COMMON = {
    "family": "llama",
    "normalization": "RMSNorm",
    "gated_linear_unit": True,
    "activation": "silu",
    "position_embedding_type": "rope",
    "share_embeddings_and_output_weights": False,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}

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
    "llama31_8b": {
        **_LLAMA3,
        "num_layers": 32,
        "hidden_size": 4096,
        "ffn_hidden_size": 14336,
        "num_attention_heads": 32,
        "num_query_groups": 8,
        "seq_length": 8192,
        "rope_scaling": True,
        "rope_scaling_factor": 8.0,
    },
    "llama31_70b": {
        **_LLAMA3,
        "num_layers": 80,
        "hidden_size": 8192,
        "ffn_hidden_size": 28672,
        "num_attention_heads": 64,
        "num_query_groups": 8,
        "seq_length": 8192,
        "rope_scaling": True,
        "rope_scaling_factor": 8.0,
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
PRESETS["llama3_405b"] = PRESETS["llama31_405b"]  # Llama-3 405B was only released as 3.1
