"""Qwen3 family (dense Qwen3): Llama's architecture with per-head RMSNorm on queries and keys (before RoPE),
a `head_dim` independent of hidden size / heads (`model.kv_channels`), and no biases."""

from __future__ import annotations

from typing import Any, ClassVar

from model_providers.core.family import shape
from model_providers.core.mapping import ConversionError
from model_providers.llama import _FIXED as _LLAMA_FIXED
from model_providers.llama import MAPPING, QK_NORM, llama_like
from model_providers.qwen2 import Qwen2Family

_FIXED = {**_LLAMA_FIXED, "qk_layernorm": True}
_COMMON = {"family": "qwen3", **_FIXED, "hidden_dropout": 0.0, "attention_dropout": 0.0, "layernorm_epsilon": 1e-6,
           "rotary_base": 1000000.0, "seq_length": 4096, "vocab_size": 151936, "max_position_embeddings": 40960,
           "kv_channels": 128, "share_embeddings_and_output_weights": False}

PRESETS: dict[str, dict] = {  # shape(base, layers, hidden, ffn, heads, query groups, **other fields)
    "tiny_qwen3": shape(_COMMON, 4, 128, 352, 8, 4, kv_channels=32, seq_length=128, vocab_size=None,
                        max_position_embeddings=None),
    "qwen3_0p6b": shape(_COMMON, 28, 1024, 3072, 16, 8, share_embeddings_and_output_weights=True),
    "qwen3_8b": shape(_COMMON, 36, 4096, 12288, 32, 8),
    "qwen3_32b": shape(_COMMON, 64, 5120, 25600, 64, 8),
}


class Qwen3Family(Qwen2Family):
    """Qwen3ForCausalLM: a Llama with q_norm/k_norm (per head) and an explicit head_dim; no biases."""

    config_class: ClassVar[str] = "Qwen3Config"
    has_head_dim: ClassVar[bool] = True

    def hf_extra(self, m: Any) -> dict:
        return {**super().hf_extra(m), "attention_bias": False}

    def fields_from_hf(self, hf: Any) -> dict:
        if getattr(hf, "attention_bias", False):
            raise ConversionError("config.json: attention_bias=true (biases on q/k/v/o_proj) is not supported for "
                                  "the qwen3 family")
        return super().fields_from_hf(hf)


FAMILY = llama_like(Qwen3Family, "qwen3", "Qwen3ForCausalLM", PRESETS, _FIXED, mapping=(*MAPPING, *QK_NORM))
