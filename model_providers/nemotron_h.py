"""Nemotron-H / Nemotron 3 family (NVIDIA Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano / Super): Megatron-Core's
hybrid `MambaModel`.

Layers follow `model.hybrid_layer_pattern`, Megatron-Core's symbols: `M` a Mamba-2 layer (RMSNorm → mixer: fused
in-projection to z, x, B, C, dt; causal depthwise conv (width 4) + silu over x, B, C; the chunked SSD scan with
`mamba_num_groups` groups of B/C shared by the heads, a per-head D skip and the silu(z) gate; RMSNorm by groups;
out-projection), `*` an attention layer (grouped-query attention, no position encoding: Nemotron-H has no RoPE),
`-` an MLP layer (squared-ReLU, not gated), `E` an MoE layer (squared-ReLU experts; a shared expert; the router of
Nemotron 3: sigmoid scores, an expert bias for choosing only (aux-loss-free balancing), top-k weights renormalised
and scaled by `routed_scaling_factor`). Every layer is one residual block; untied embeddings; RMSNorm (eps 1e-5).

Shapes follow Megatron-Bridge's Nemotron-H providers and the released config.json files (docs/hybrid.md).
"""

from __future__ import annotations

from model_providers.core.family import Family

# What makes a model a Nemotron-H (checked on export, set on import).
_FIXED = {"normalization": "RMSNorm", "gated_linear_unit": False, "activation": "squared_relu",
          "position_embedding_type": "none", "add_bias_linear": False, "add_qkv_bias": False, "qk_layernorm": False,
          "multi_latent_attention": False}
# Nemotron 3's MoE routing (Megatron-Bridge's NemotronHModelProvider).
_ROUTER = {"moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False,
           "moe_router_enable_expert_bias": True, "moe_router_dtype": "fp32", "moe_router_bias_update_rate": 1e-3,
           "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4}
_COMMON = {"family": "nemotron_h", **_FIXED, "share_embeddings_and_output_weights": False, "layernorm_epsilon": 1e-5,
           "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.02, "mamba_conv_kernel": 4,
           "mamba_chunk_size": 128, "mamba_num_groups": 8, "mamba_head_dim": 64, "mamba_state_dim": 128,
           "vocab_size": 131072, "seq_length": 8192}

_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"

PRESETS: dict[str, dict] = {
    # CPU-sized Nemotron 3: one layer of each kind and a second Mamba layer (M*M-ME), 64 wide; 8 Mamba heads of 8 in
    # 2 groups, state 16, chunk 8 (sequence 32 = 4 chunks); 4 heads / 2 KV groups of 16; 4 squared-ReLU experts of 32
    # (top-2) and a shared one of 48, Nemotron 3's router.
    "tiny_nemotron_h": {**_COMMON, **_ROUTER, "num_layers": 6, "hybrid_layer_pattern": "M*M-ME", "hidden_size": 64,
                        "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 16,
                        "mamba_num_heads": 8, "mamba_head_dim": 8, "mamba_num_groups": 2, "mamba_state_dim": 16,
                        "mamba_chunk_size": 8, "num_moe_experts": 4, "moe_ffn_hidden_size": 32,
                        "moe_shared_expert_intermediate_size": 48, "moe_router_topk": 2,
                        "moe_router_topk_scaling_factor": 2.5, "moe_aux_loss_coeff": 1e-3, "vocab_size": None,
                        "seq_length": 32, "max_position_embeddings": 64},
    # Nemotron 3 Nano 30B-A3B: 52 layers (23 Mamba-2, 23 MoE, 6 attention), 128 experts + 1 shared, top-6.
    "nemotron3_nano": {**_COMMON, **_ROUTER, "num_layers": 52, "hybrid_layer_pattern": _NANO_PATTERN,
                       "hidden_size": 2688, "ffn_hidden_size": 1856, "num_attention_heads": 32, "num_query_groups": 2,
                       "kv_channels": 128, "mamba_num_heads": 64, "num_moe_experts": 128, "moe_ffn_hidden_size": 1856,
                       "moe_shared_expert_intermediate_size": 3712, "moe_router_topk": 6,
                       "moe_router_topk_scaling_factor": 2.5, "max_position_embeddings": 262144},
}


class NemotronHFamily(Family):
    """NemotronHForCausalLM both ways (docs/hf.md "Nemotron-H")."""


FAMILY = NemotronHFamily(name="nemotron_h", hf_architecture="NemotronHForCausalLM", hf_model_type="nemotron_h",
                         presets=PRESETS, mapping=(), fixed_fields=_FIXED)
