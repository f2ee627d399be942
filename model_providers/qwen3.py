"""Qwen3 family (dense Qwen3): Llama's architecture with per-head RMSNorm on queries and keys (before RoPE),
a `head_dim` independent of hidden size / heads (`model.kv_channels`), and no biases."""

from __future__ import annotations

from typing import Any, ClassVar

from model_providers.core.mapping import ConversionError
from model_providers.llama import _FIXED as _LLAMA_FIXED
from model_providers.llama import MAPPING, QK_NORM, ROTARY_BUFFERS
from model_providers.qwen2 import Qwen2Family

_FIXED = {**_LLAMA_FIXED, "qk_layernorm": True}
_COMMON = {"family": "qwen3", **_FIXED, "hidden_dropout": 0.0, "attention_dropout": 0.0, "layernorm_epsilon": 1e-6,
           "rotary_base": 1000000.0, "seq_length": 4096, "vocab_size": 151936, "max_position_embeddings": 40960,
           "kv_channels": 128, "share_embeddings_and_output_weights": False}

PRESETS: dict[str, dict] = {
    "tiny_qwen3": {**_COMMON, "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 352, "num_attention_heads": 8,
                   "num_query_groups": 4, "kv_channels": 32, "seq_length": 128, "vocab_size": None,
                   "max_position_embeddings": None},
    "qwen3_0p6b": {**_COMMON, "num_layers": 28, "hidden_size": 1024, "ffn_hidden_size": 3072,
                   "num_attention_heads": 16, "num_query_groups": 8, "share_embeddings_and_output_weights": True},
    "qwen3_8b": {**_COMMON, "num_layers": 36, "hidden_size": 4096, "ffn_hidden_size": 12288,
                 "num_attention_heads": 32, "num_query_groups": 8},
    "qwen3_32b": {**_COMMON, "num_layers": 64, "hidden_size": 5120, "ffn_hidden_size": 25600,
                  "num_attention_heads": 64, "num_query_groups": 8},
}


class Qwen3Family(Qwen2Family):
    """Qwen3ForCausalLM: a Llama with q_norm/k_norm (per head) and an explicit head_dim; no biases."""

    config_class: ClassVar[str] = "Qwen3Config"
    has_head_dim: ClassVar[bool] = True

    def hf_extra(self, m: Any) -> dict:
        return {**super().hf_extra(m), "attention_bias": False}

    def fields_from_hf(self, cfg: Any) -> dict:
        if getattr(cfg, "attention_bias", False):
            raise ConversionError("config.json: attention_bias=true (biases on q/k/v/o_proj) is not supported for "
                                  "the qwen3 family")
        return super().fields_from_hf(cfg)


FAMILY = Qwen3Family(
    name="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    hf_model_type="qwen3",
    presets=PRESETS,
    fixed_fields=_FIXED,
    mapping=(*MAPPING, *QK_NORM),
    hf_ignored=ROTARY_BUFFERS,
)
