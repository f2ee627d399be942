"""Mixtral family (sparse Mixture of Experts on a Mistral body): presets, the HF mapping, config both ways.

Every layer's MLP is `num_moe_experts` SwiGLU experts of size `ffn_hidden_size` (HF `intermediate_size`) behind a
linear router; each token goes to its top-k experts with softmax weights renormalised over those k (Megatron's
softmax over the top-k logits, `moe_router_pre_softmax=false`, is the same function). The `tiny_moe` preset is
the CPU-sized shape the tests and `pretrain/configs/tiny_moe.yaml` train with expert parallelism. Shapes follow
the released config.json files. The MoE helpers here are shared with `qwen3_moe`.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from model_providers.core.mapping import ConversionError, Copy, GateUp
from model_providers.llama import _FIXED as _LLAMA_FIXED
from model_providers.llama import MAPPING, llama_like
from model_providers.mistral import MistralFamily

# What makes a model a Mixtral (checked on export, set on import).
_FIXED = {**_LLAMA_FIXED, "moe_router_score_function": "softmax", "moe_router_pre_softmax": False}
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
                     "vocab_size": 32000, "max_position_embeddings": 32768, "num_moe_experts": 8},
}

_L = "model.layers.{i}."
_M = "decoder.layers."
EXPERTS = "decoder.layers.mlp.experts.experts."  # Megatron's expert weights: [layers, experts, ...]
# Llama's attention, norms and embeddings; the dense MLP rows are replaced by the router and experts. The MoE
# layer has its own pre-MLP norm (not one fused into a dense fc1).
ATTENTION = (*(r for r in MAPPING if not r.megatron.startswith(_M + "mlp.")),
             Copy(_M + "pre_mlp_layernorm.weight", _L + "post_attention_layernorm.weight"))


def moe_hf_kwargs(m: Any, arch: str) -> dict:
    """transformers kwargs every MoE config class here shares (routing and its loss)."""
    if m.num_moe_experts is None:
        raise ConversionError(f"model.num_moe_experts is null: a {arch} needs experts")
    return {"num_experts_per_tok": m.moe_router_topk, "router_aux_loss_coef": m.moe_aux_loss_coeff,
            "output_router_logits": False}


def moe_fields(hf: Any) -> dict:
    """Our routing fields of a transformers MoE config."""
    return {"num_moe_experts": hf.num_local_experts, "moe_router_topk": hf.num_experts_per_tok,
            "moe_aux_loss_coeff": float(hf.router_aux_loss_coef), "moe_router_load_balancing_type": "aux_loss"}


class MixtralFamily(MistralFamily):
    """MixtralForCausalLM: Mistral attention (GQA, RoPE, RMSNorm, optional sliding window) with top-k routed
    SwiGLU experts in every layer."""

    config_class: ClassVar[str] = "MixtralConfig"
    has_head_dim: ClassVar[bool] = False  # released configs leave it out (hidden / heads)

    def hf_extra(self, m: Any) -> dict:
        ffn = m.ffn_hidden_size or 4 * m.hidden_size
        if (m.moe_ffn_hidden_size or ffn) != ffn:
            raise ConversionError(f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} differs from "
                                  f"model.ffn_hidden_size={ffn}: MixtralForCausalLM has one FFN size")
        return {**super().hf_extra(m), **moe_hf_kwargs(m, self.hf_architecture),
                "num_local_experts": m.num_moe_experts, "router_jitter_noise": 0.0}

    def fields_from_hf(self, hf: Any) -> dict:
        if float(getattr(hf, "router_jitter_noise", 0.0) or 0.0) > 0:
            print(f"[convert] warning: HF router_jitter_noise={hf.router_jitter_noise} is not used by the "
                  "trainer", file=sys.stderr)
        return {**super().fields_from_hf(hf), **moe_fields(hf), "moe_ffn_hidden_size": None}  # = ffn_hidden_size


def moe_rules(router: str, gate: str, up: str, down: str) -> tuple:
    """The router and per-expert rules, from the HF names of one layer (`{i}`) and expert (`{e}`)."""
    return (Copy(_M + "mlp.router.weight", router), GateUp(EXPERTS + "linear_fc1.weight", (gate, up)),
            Copy(EXPERTS + "linear_fc2.weight", down))


_E = _L + "block_sparse_moe.experts.{e}."
FAMILY = llama_like(MixtralFamily, "mixtral", "MixtralForCausalLM", PRESETS, _FIXED, mapping=(
    *ATTENTION, *moe_rules(_L + "block_sparse_moe.gate.weight", _E + "w1.weight", _E + "w3.weight", _E + "w2.weight")))
