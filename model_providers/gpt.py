"""GPT family (GPT-2/GPT-3 style: LayerNorm, GELU, biases, learned positions, tied embeddings):
presets, the HuggingFace mapping and config both ways."""

from __future__ import annotations

import sys
from typing import Any

from model_providers.core.family import Family, require
from model_providers.core.mapping import ConversionError, Copy, FusedQKV, FusedQKVBias, Transpose, Vocab

# What makes a model a GPT-2 (checked on export, set on import).
_FIXED = {"normalization": "LayerNorm", "gated_linear_unit": False, "activation": "gelu",
          "position_embedding_type": "learned_absolute", "add_bias_linear": True, "add_qkv_bias": True,
          "qk_layernorm": False}
_GPT_COMMON = {"family": "gpt", **_FIXED, "share_embeddings_and_output_weights": True, "layernorm_epsilon": 1e-5}

PRESETS: dict[str, dict] = {
    "tiny_gpt": {
        **_GPT_COMMON,
        "num_layers": 4,
        "hidden_size": 128,
        "ffn_hidden_size": 512,
        "num_attention_heads": 8,
        "seq_length": 128,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    },
    "gpt2_small": {
        **_GPT_COMMON,
        "num_layers": 12,
        "hidden_size": 768,
        "ffn_hidden_size": 3072,
        "num_attention_heads": 12,
        "seq_length": 1024,
        "vocab_size": 50257,
    },
    "gpt2_medium": {
        **_GPT_COMMON,
        "num_layers": 24,
        "hidden_size": 1024,
        "ffn_hidden_size": 4096,
        "num_attention_heads": 16,
        "seq_length": 1024,
        "vocab_size": 50257,
    },
    "gpt3_1p3b": {
        **_GPT_COMMON,
        "num_layers": 24,
        "hidden_size": 2048,
        "ffn_hidden_size": 8192,
        "num_attention_heads": 16,
        "seq_length": 2048,
        "vocab_size": 50257,
    },
}

# GPT-2's Conv1D stores weights as [in, out], hence `Transpose`; its fused c_attn is [q; k; v] over all
# heads, while Megatron's linear_qkv is [q; k; v] per head: `FusedQKV` / `FusedQKVBias` regroup and transpose.
_H = "transformer.h.{i}."
_M = "decoder.layers."


class GPTFamily(Family):
    """GPT2LMHeadModel: LayerNorm, exact GELU, biases, learned positions, tied embeddings, no GQA."""

    def to_hf_config(self, m: Any, vocab: int, *, bos: int | None, eos: int | None, dtype: Any,
                     base: Any = None) -> Any:
        from transformers import GPT2Config

        self.require_fixed_fields(m)
        require(m, "sliding_window", None, self.hf_architecture)
        heads = m.num_attention_heads
        head_dim = m.kv_channels or m.hidden_size // heads
        if (m.num_query_groups or heads) != heads:
            raise ConversionError(f"model.num_query_groups={m.num_query_groups}: GPT2LMHeadModel has no GQA")
        if head_dim * heads != m.hidden_size:
            raise ConversionError(f"model.kv_channels={m.kv_channels}: GPT2LMHeadModel needs heads × head_dim = hidden")
        arch = dict(
            vocab_size=vocab, n_positions=m.max_position_embeddings or m.seq_length, n_embd=m.hidden_size,
            n_layer=m.num_layers, n_head=heads,
            n_inner=None if (m.ffn_hidden_size or 4 * m.hidden_size) == 4 * m.hidden_size else m.ffn_hidden_size,
            activation_function="gelu",  # exact erf GELU, as F.gelu
            resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout,
            layer_norm_epsilon=m.layernorm_epsilon, tie_word_embeddings=m.share_embeddings_and_output_weights,
            architectures=[self.hf_architecture], dtype=str(dtype).removeprefix("torch."),
        )
        return self.hf_config(GPT2Config, arch, bos=bos, eos=eos, base=base)

    def from_hf_config(self, hf: Any) -> dict:
        if getattr(hf, "activation_function", "gelu") != "gelu":
            print(f"[convert] warning: HF activation_function={hf.activation_function!r}; Megatron uses exact GELU, "
                  "so outputs will differ slightly", file=sys.stderr)
        return {
            **self.fixed_fields, "family": self.name,
            "num_layers": hf.n_layer, "hidden_size": hf.n_embd, "ffn_hidden_size": hf.n_inner or 4 * hf.n_embd,
            "num_attention_heads": hf.n_head, "num_query_groups": None, "kv_channels": None,
            "layernorm_epsilon": float(hf.layer_norm_epsilon), "seq_length": hf.n_positions,
            "max_position_embeddings": hf.n_positions,
            "share_embeddings_and_output_weights": bool(hf.tie_word_embeddings), "vocab_size": hf.vocab_size,
            "hidden_dropout": float(hf.resid_pdrop), "attention_dropout": float(hf.attn_pdrop),
        }


def _norm(megatron: str, hf: str) -> tuple:
    """A LayerNorm's weight and bias (`megatron` + weight/bias, `hf` + weight/bias)."""
    return Copy(megatron + "weight", hf + "weight"), Copy(megatron + "bias", hf + "bias")


def _conv1d(megatron: str, hf: str) -> tuple:
    """A linear layer GPT-2 stores as Conv1D (weight transposed) and its bias."""
    return Transpose(megatron + "weight", hf + "weight"), Copy(megatron + "bias", hf + "bias")


FAMILY = GPTFamily(
    name="gpt",
    hf_architecture="GPT2LMHeadModel",
    hf_model_type="gpt2",
    presets=PRESETS,
    fixed_fields=_FIXED,
    mapping=(
        Vocab("embedding.word_embeddings.weight", "transformer.wte.weight"),
        Copy("embedding.position_embeddings.weight", "transformer.wpe.weight"),
        *_norm(_M + "self_attention.linear_qkv.layer_norm_", _H + "ln_1."),
        FusedQKV(_M + "self_attention.linear_qkv.weight", _H + "attn.c_attn.weight"),
        FusedQKVBias(_M + "self_attention.linear_qkv.bias", _H + "attn.c_attn.bias"),
        *_conv1d(_M + "self_attention.linear_proj.", _H + "attn.c_proj."),
        *_norm(_M + "mlp.linear_fc1.layer_norm_", _H + "ln_2."),
        *_conv1d(_M + "mlp.linear_fc1.", _H + "mlp.c_fc."),
        *_conv1d(_M + "mlp.linear_fc2.", _H + "mlp.c_proj."),
        *_norm("decoder.final_layernorm.", "transformer.ln_f."),
        Vocab("output_layer.weight", "lm_head.weight"),
    ),
    # Causal-mask buffers older GPT-2 checkpoints carry; skipped on import.
    hf_ignored=(r"transformer\.h\.\d+\.attn\.(masked_)?bias",),
)
