"""Qwen3-MoE family: Qwen3 attention (per-head RMSNorm on queries and keys, explicit head_dim, no biases) with
top-k routed SwiGLU experts of size `moe_ffn_hidden_size` (HF `moe_intermediate_size`) in every layer.

Routing: softmax over all experts, top k; `norm_topk_prob=true` (the released models) renormalises over the k,
which is Megatron's softmax over the top-k logits (`moe_router_pre_softmax=false`); `norm_topk_prob=false` is
`moe_router_pre_softmax=true`. Shapes follow the released config.json files.
"""

from __future__ import annotations

from typing import Any, ClassVar

from model_providers.core.mapping import ConversionError
from model_providers.llama import QK_NORM, llama_like
from model_providers.mixtral import ATTENTION, moe_fields, moe_hf_kwargs, moe_rules
from model_providers.qwen3 import _FIXED as _QWEN3_FIXED
from model_providers.qwen3 import Qwen3Family

# What makes a model a Qwen3-MoE (checked on export, set on import).
_FIXED = {**_QWEN3_FIXED, "moe_router_score_function": "softmax"}
_COMMON = {"family": "qwen3_moe", **_FIXED, "share_embeddings_and_output_weights": False, "hidden_dropout": 0.0,
           "attention_dropout": 0.0, "layernorm_epsilon": 1e-6, "rotary_base": 1e6, "kv_channels": 128,
           "moe_router_topk": 8, "moe_router_pre_softmax": False, "moe_router_load_balancing_type": "aux_loss",
           "moe_aux_loss_coeff": 0.001, "vocab_size": 151936, "seq_length": 4096, "max_position_embeddings": 40960,
           "num_moe_experts": 128}

PRESETS: dict[str, dict] = {
    # CPU-sized Qwen3-MoE: QK-norm, head_dim 32 ≠ hidden / heads, 8 experts of 64, top-2.
    "tiny_qwen3_moe": {**_COMMON, "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 256,
                       "num_attention_heads": 8, "num_query_groups": 4, "kv_channels": 32, "seq_length": 128,
                       "num_moe_experts": 8, "moe_ffn_hidden_size": 64, "moe_router_topk": 2, "vocab_size": None,
                       "max_position_embeddings": None},
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token.
    "qwen3_30b_a3b": {**_COMMON, "num_layers": 48, "hidden_size": 2048, "ffn_hidden_size": 6144,
                      "num_attention_heads": 32, "num_query_groups": 4, "moe_ffn_hidden_size": 768},
    # Qwen3-235B-A22B: 235B parameters, 22B active per token.
    "qwen3_235b_a22b": {**_COMMON, "num_layers": 94, "hidden_size": 4096, "ffn_hidden_size": 12288,
                        "num_attention_heads": 64, "num_query_groups": 4, "moe_ffn_hidden_size": 1536},
}

_L = "model.layers.{i}."
_M = "decoder.layers."


class Qwen3MoeFamily(Qwen3Family):
    """Qwen3MoeForCausalLM: QK-norm attention with top-k routed SwiGLU experts in every layer."""

    config_class: ClassVar[str] = "Qwen3MoeConfig"

    def hf_extra(self, m: Any) -> dict:
        ffn = m.ffn_hidden_size or 4 * m.hidden_size
        return {**super().hf_extra(m), **moe_hf_kwargs(m, self.hf_architecture), "num_experts": m.num_moe_experts,
                "moe_intermediate_size": m.moe_ffn_hidden_size or ffn, "norm_topk_prob": not m.moe_router_pre_softmax,
                "decoder_sparse_step": 1, "mlp_only_layers": []}

    def fields_from_hf(self, hf: Any) -> dict:
        layers = hf.num_hidden_layers
        step = max(int(hf.decoder_sparse_step), 1)
        dense = sorted(set(hf.mlp_only_layers or []) | {i for i in range(layers) if (i + 1) % step})
        if dense or hf.num_experts <= 0:
            raise ConversionError(f"config.json: layers {dense[:8]} have a dense MLP (mlp_only_layers / "
                                  "decoder_sparse_step); only models with experts in every layer are supported")
        return {**super().fields_from_hf(hf), **moe_fields(hf), "moe_ffn_hidden_size": hf.moe_intermediate_size,
                "moe_router_pre_softmax": not hf.norm_topk_prob}

    def config_json(self, hf_cfg: Any) -> dict:
        """As released Qwen3-MoE configs spell it: `num_experts` (transformers writes its alias)."""
        out = super().config_json(hf_cfg)
        if "num_local_experts" in out:
            out["num_experts"] = out.pop("num_local_experts")
        return out


_E = _L + "mlp.experts.{e}."
FAMILY = llama_like(Qwen3MoeFamily, "qwen3_moe", "Qwen3MoeForCausalLM", PRESETS, _FIXED, mapping=(
    *ATTENTION, *QK_NORM, *moe_rules(_L + "mlp.gate.weight", _E + "gate_proj.weight", _E + "up_proj.weight",
                                     _E + "down_proj.weight")))
