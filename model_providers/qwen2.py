"""Qwen2 family (Qwen2 / Qwen2.5): Llama's architecture with biases on the q, k and v projections.

The small Qwen2.5 models tie the embeddings. `use_sliding_window` (off in every released Qwen2.5) becomes
`model.sliding_window`, with the same rule as Mistral's: training needs `model.seq_length <= sliding_window`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from model_providers.core.family import shape
from model_providers.llama import _FIXED as _LLAMA_FIXED
from model_providers.llama import MAPPING, QKV_BIAS, LlamaFamily, llama_like

_FIXED = {**_LLAMA_FIXED, "add_qkv_bias": True}
_COMMON = {"family": "qwen2", **_FIXED, "hidden_dropout": 0.0, "attention_dropout": 0.0, "layernorm_epsilon": 1e-6,
           "rotary_base": 1000000.0, "seq_length": 4096}
_QWEN25 = {**_COMMON, "vocab_size": 152064, "max_position_embeddings": 131072,
           "share_embeddings_and_output_weights": False}

PRESETS: dict[str, dict] = {  # shape(base, layers, hidden, ffn, heads, query groups, **other fields)
    "tiny_qwen2": shape(_COMMON, 4, 128, 352, 8, 2, seq_length=128, share_embeddings_and_output_weights=True),
    "qwen25_0p5b": shape(_COMMON, 24, 896, 4864, 14, 2, vocab_size=151936, max_position_embeddings=32768,
                         share_embeddings_and_output_weights=True),
    "qwen25_7b": shape(_QWEN25, 28, 3584, 18944, 28, 4),
    "qwen25_72b": shape(_QWEN25, 80, 8192, 29568, 64, 8),
}


class Qwen2Family(LlamaFamily):
    """Qwen2ForCausalLM: a Llama with q/k/v biases (not on o_proj)."""

    config_class: ClassVar[str] = "Qwen2Config"
    has_head_dim: ClassVar[bool] = False  # Qwen2Attention reads `head_dim` when present, else hidden / heads

    def hf_extra(self, m: Any) -> dict:
        return {"use_sliding_window": m.sliding_window is not None, "sliding_window": m.sliding_window}

    def fields_from_hf(self, cfg: Any) -> dict:
        return {"sliding_window": cfg.sliding_window}  # transformers sets it to None without use_sliding_window


FAMILY = llama_like(Qwen2Family, "qwen2", "Qwen2ForCausalLM", PRESETS, _FIXED, mapping=(*MAPPING, QKV_BIAS))
