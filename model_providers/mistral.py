"""Mistral family (Mistral-7B v0.1 / v0.3): Llama's architecture with its own HF class and a sliding window.

`sliding_window` (v0.1: 4096) is `model.sliding_window`, on every layer: a token attends to itself and the 4095
tokens before it (`model_providers/core/windows.py`), also when the training length is longer. `tiny_mistral_swa`
is a CPU-sized model whose window (32) is shorter than its training length (128).
"""

from __future__ import annotations

from typing import Any, ClassVar

from model_providers.core.family import require
from model_providers.llama import _FIXED, LlamaFamily, llama_like

_COMMON = {"family": "mistral", **_FIXED, "share_embeddings_and_output_weights": False, "hidden_dropout": 0.0,
           "attention_dropout": 0.0, "layernorm_epsilon": 1e-5}
_7B = {**_COMMON, "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
       "num_query_groups": 8, "max_position_embeddings": 32768, "seq_length": 4096}

PRESETS: dict[str, dict] = {
    "tiny_mistral": {**_COMMON, "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 352, "num_attention_heads": 8,
                     "num_query_groups": 2, "seq_length": 128, "rotary_base": 10000.0, "sliding_window": 128},
    "tiny_mistral_swa": {**_COMMON, "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 352,
                         "num_attention_heads": 8, "num_query_groups": 2, "seq_length": 128, "rotary_base": 10000.0,
                         "sliding_window": 32},
    "mistral_7b": {**_7B, "vocab_size": 32000, "rotary_base": 10000.0, "sliding_window": 4096},  # v0.1
    "mistral_7b_v03": {**_7B, "vocab_size": 32768, "rotary_base": 1000000.0},
}


class MistralFamily(LlamaFamily):
    """MistralForCausalLM: a Llama with `sliding_window` (no biases, no QK-norm)."""

    config_class: ClassVar[str] = "MistralConfig"

    def hf_extra(self, m: Any) -> dict:
        require(m, "window_attn_skip_freq", None, self.hf_architecture)  # MistralConfig windows every layer
        return {"sliding_window": m.sliding_window}

    def fields_from_hf(self, hf: Any) -> dict:
        return {"sliding_window": hf.sliding_window, "window_attn_skip_freq": None}


FAMILY = llama_like(MistralFamily, "mistral", "MistralForCausalLM", PRESETS, _FIXED)
