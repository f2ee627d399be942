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

from typing import ClassVar

from model_providers.core.family import Family, shape

# What makes a model a GPT-OSS (checked on export, set on import).
_FIXED = {"normalization": "RMSNorm", "gated_linear_unit": True, "activation": "quick_gelu",
          "glu_linear_offset": 1.0, "position_embedding_type": "yarn", "add_bias_linear": True, "add_qkv_bias": True,
          "qk_layernorm": False, "softmax_type": "learnable", "moe_router_score_function": "softmax",
          "moe_router_pre_softmax": False, "window_attn_skip_freq": 2, "share_embeddings_and_output_weights": False}
_COMMON = {"family": "gpt_oss", **_FIXED, "activation_func_clamp_value": 7.0, "layernorm_epsilon": 1e-5,
           "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.02, "rotary_base": 150000.0,
           "rotary_scaling_factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0, "yarn_correction_range_round_to_int": False,
           "sliding_window": 128, "kv_channels": 64, "moe_router_topk": 4, "moe_ffn_hidden_size": 2880,
           "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0, "vocab_size": 201088,
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


class GptOssFamily(Family):
    """GptOssForCausalLM. The HF config both ways and the weight mapping (fused, interleaved gate/up experts,
    MXFP4 expert blocks) belong to the HF bridge's part of this family."""

    config_class: ClassVar[str] = "GptOssConfig"


FAMILY = GptOssFamily(name="gpt_oss", hf_architecture="GptOssForCausalLM", hf_model_type="gpt_oss",
                      presets=PRESETS, mapping=(), fixed_fields=_FIXED)
