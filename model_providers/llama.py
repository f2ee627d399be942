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

# HuggingFace mapping, shared by export (data_tools convert to-hf) and import (from-hf); the rules are
# implemented in model_providers/hf.py. Each row: Megatron global parameter name (names under
# "decoder.layers." are stacked on dim 0, one slice per layer) → HF name(s) ({i} = layer) → rule.
#   copy: same tensor | vocab: rows = vocabulary (TP padding removed on export, added on import)
#   split_qkv: fused per-query-group [q heads; k; v] ↔ q_proj, k_proj, v_proj
#   split_gate_up: fc1 = [gate; up] ↔ gate_proj, up_proj
_L = "model.layers.{i}."
HF_MAPPING: tuple[tuple[str, str | tuple[str, ...], str], ...] = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight", "vocab"),
    ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", _L + "input_layernorm.weight", "copy"),
    (
        "decoder.layers.self_attention.linear_qkv.weight",
        (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
        "split_qkv",
    ),
    ("decoder.layers.self_attention.linear_proj.weight", _L + "self_attn.o_proj.weight", "copy"),
    ("decoder.layers.mlp.linear_fc1.layer_norm_weight", _L + "post_attention_layernorm.weight", "copy"),
    ("decoder.layers.mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), "split_gate_up"),
    ("decoder.layers.mlp.linear_fc2.weight", _L + "mlp.down_proj.weight", "copy"),
    ("decoder.final_layernorm.weight", "model.norm.weight", "copy"),
    ("output_layer.weight", "lm_head.weight", "vocab"),
)
# HF tensors that carry no weights (buffers some checkpoints include); skipped on import.
HF_IGNORED: tuple[str, ...] = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
