"""Qwen2 family (Qwen2 / Qwen2.5): Llama's architecture with biases on the q, k and v projections.

The small Qwen2.5 models tie the embeddings. `use_sliding_window` (off in every released Qwen2.5) becomes
`model.sliding_window`; transformers windows the layers from `max_window_layers` on (its `layer_types`), which
becomes `model.window_attn_skip_freq` (a 0/1 list; null when every layer is windowed). Exported back as
`max_window_layers` when the windowed layers are the last ones, else as `layer_types`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from model_providers.core.family import shape
from model_providers.core.windows import layer_windowed
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
        window = m.sliding_window
        out = {"use_sliding_window": window is not None, "sliding_window": window}
        if window is None:
            return out
        pattern = [layer_windowed(m.window_attn_skip_freq, i + 1) for i in range(m.num_layers)]
        full = pattern.index(True) if any(pattern) else m.num_layers  # leading full layers
        if all(pattern[full:]):
            out["max_window_layers"] = full
        else:
            out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in pattern]
        return out

    def fields_from_hf(self, hf: Any) -> dict:
        window = hf.sliding_window  # transformers sets it to None without use_sliding_window
        if window is None:
            return {"sliding_window": None, "window_attn_skip_freq": None}
        pattern = [int(t == "sliding_attention") for t in hf.layer_types]
        return {"sliding_window": int(window), "window_attn_skip_freq": None if all(pattern) else pattern}


FAMILY = llama_like(Qwen2Family, "qwen2", "Qwen2ForCausalLM", PRESETS, _FIXED, mapping=(*MAPPING, QKV_BIAS))
