"""HuggingFace bridge rules: the split/merge operations named in each family's `HF_MAPPING` table, and
the translation between our model config and a transformers `config.json`.

Every rule works on one layer's slice at a time (`to_hf`: Megatron tensor → HF tensors; `from_hf`: the
inverse), so conversions hold only one layer of one parameter in memory. Rules run on `meta` tensors
too, which is how shapes are planned before any data is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

import model_providers


class ConversionError(ValueError):
    """A checkpoint, HF model or config that cannot be converted; the message names the tensor or key."""


@dataclass(frozen=True)
class Dims:
    """The sizes the rules need."""

    num_heads: int
    num_groups: int
    head_dim: int
    hidden: int
    vocab: int  # the true vocabulary (HF side)
    padded_vocab: int  # rows on the Megatron side (TP padding)


@dataclass(frozen=True)
class Rule:
    """One row of a family's HF_MAPPING table."""

    megatron: str
    hf: tuple[str, ...]
    op: str

    @property
    def stacked(self) -> bool:
        """Layer parameters are stored stacked on dim 0 (one slice per layer)."""
        return self.megatron.startswith("decoder.layers.")

    def hf_names(self, layer: int | None) -> list[str]:
        return [n.format(i=layer) for n in self.hf]


def rules(family: str) -> list[Rule]:
    """The family's mapping table as `Rule`s."""
    table = model_providers.get_family(family).HF_MAPPING
    return [Rule(m, (h,) if isinstance(h, str) else tuple(h), op) for m, h, op in table]


def ignored_patterns(family: str) -> list[re.Pattern]:
    return [re.compile(p) for p in getattr(model_providers.get_family(family), "HF_IGNORED", ())]


# --------------------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------------------


def to_hf(op: str, t: torch.Tensor, d: Dims) -> list[torch.Tensor]:
    """One Megatron slice → the HF tensor(s) of the rule `op`."""
    qpg = d.num_heads // d.num_groups
    if op == "copy":
        return [t]
    if op == "vocab":
        if t.shape[0] < d.vocab:
            raise ConversionError(f"{t.shape[0]} rows < vocabulary {d.vocab}")
        return [t[: d.vocab]]
    if op == "transpose":
        return [t.t()]
    if op == "split_qkv":
        g = t.reshape(d.num_groups, qpg + 2, d.head_dim, -1)
        h = g.shape[-1]
        q = g[:, :qpg].reshape(d.num_heads * d.head_dim, h)
        k = g[:, qpg].reshape(d.num_groups * d.head_dim, h)
        v = g[:, qpg + 1].reshape(d.num_groups * d.head_dim, h)
        return [q, k, v]
    if op == "split_gate_up":
        if t.shape[0] % 2:
            raise ConversionError(f"gated fc1 has an odd number of rows ({t.shape[0]})")
        return list(t.chunk(2, dim=0))
    if op == "fused_qkv":  # per head [q;k;v] rows → Conv1D [in, q_all|k_all|v_all]
        g = t.reshape(d.num_heads, 3, d.head_dim, -1)
        return [g.permute(1, 0, 2, 3).reshape(3 * d.num_heads * d.head_dim, -1).t()]
    if op == "fused_qkv_bias":
        return [t.reshape(d.num_heads, 3, d.head_dim).permute(1, 0, 2).reshape(-1)]
    raise ConversionError(f"unknown mapping rule '{op}'")


def from_hf(op: str, ts: list[torch.Tensor], d: Dims) -> torch.Tensor:
    """The HF tensor(s) of the rule `op` → one Megatron slice."""
    qpg = d.num_heads // d.num_groups
    if op == "copy":
        return ts[0]
    if op == "vocab":
        t = ts[0]
        if t.shape[0] != d.vocab:
            raise ConversionError(f"{t.shape[0]} rows, expected vocab_size {d.vocab}")
        if d.padded_vocab == d.vocab:
            return t
        pad = torch.zeros((d.padded_vocab - d.vocab, *t.shape[1:]), dtype=t.dtype, device=t.device)
        return torch.cat([t, pad], dim=0)
    if op == "transpose":
        return ts[0].t()
    if op == "split_qkv":
        q, k, v = ts
        h = q.shape[-1]
        parts = [
            q.reshape(d.num_groups, qpg, d.head_dim, h),
            k.reshape(d.num_groups, 1, d.head_dim, h),
            v.reshape(d.num_groups, 1, d.head_dim, h),
        ]
        return torch.cat(parts, dim=1).reshape(-1, h)
    if op == "split_gate_up":
        return torch.cat(ts, dim=0)
    if op == "fused_qkv":
        w = ts[0].t().reshape(3, d.num_heads, d.head_dim, -1)
        return w.permute(1, 0, 2, 3).reshape(3 * d.num_heads * d.head_dim, -1)
    if op == "fused_qkv_bias":
        return ts[0].reshape(3, d.num_heads, d.head_dim).permute(1, 0, 2).reshape(-1)
    raise ConversionError(f"unknown mapping rule '{op}'")


def dims(m, vocab: int, padded_vocab: int) -> Dims:
    """Dims from our `ModelConfig`."""
    heads = m.num_attention_heads
    return Dims(
        num_heads=heads,
        num_groups=m.num_query_groups or heads,
        head_dim=m.kv_channels or m.hidden_size // heads,
        hidden=m.hidden_size,
        vocab=vocab,
        padded_vocab=padded_vocab,
    )


# --------------------------------------------------------------------------------------------------
# config.json ↔ ModelConfig
# --------------------------------------------------------------------------------------------------

# Megatron-Core's Llama-3.1 RoPE scaling constants (RotaryEmbedding._apply_scaling defaults).
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _require(m, field: str, expected, arch: str) -> None:
    value = getattr(m, field)
    if value != expected:
        raise ConversionError(f"model.{field}={value!r} cannot be expressed as {arch} (needs {expected!r})")


def hf_config(m, vocab: int, *, bos: int | None, eos: int | None, dtype: torch.dtype):
    """A transformers config (LlamaConfig / GPT2Config) equivalent to our model config."""
    from transformers import GPT2Config, LlamaConfig

    heads = m.num_attention_heads
    head_dim = m.kv_channels or m.hidden_size // heads
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    _require(m, "apply_residual_connection_post_layernorm", False, "a transformers model")
    if m.position_embedding_type == "rope":
        _require(m, "rotary_percent", 1.0, "a transformers model")
    dtype_name = str(dtype).removeprefix("torch.")
    if m.family == "llama":
        arch = "LlamaForCausalLM"
        for field, expected in (("normalization", "RMSNorm"), ("gated_linear_unit", True), ("activation", "silu"),
                                ("position_embedding_type", "rope"), ("add_bias_linear", False),
                                ("add_qkv_bias", False)):
            _require(m, field, expected, arch)
        rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
        max_pos = m.seq_length
        if m.rope_scaling:
            rope = {"rope_type": "llama3", "rope_theta": float(m.rotary_base), "factor": float(m.rope_scaling_factor),
                    **LLAMA3_ROPE}
            max_pos = max(m.seq_length, int(LLAMA3_ROPE["original_max_position_embeddings"] * m.rope_scaling_factor))
        cfg = LlamaConfig(
            vocab_size=vocab, hidden_size=m.hidden_size, intermediate_size=ffn, num_hidden_layers=m.num_layers,
            num_attention_heads=heads, num_key_value_heads=m.num_query_groups or heads, head_dim=head_dim,
            hidden_act="silu", max_position_embeddings=max_pos, rms_norm_eps=m.layernorm_epsilon,
            rope_parameters=rope, attention_bias=False, mlp_bias=False, attention_dropout=m.attention_dropout,
            tie_word_embeddings=m.share_embeddings_and_output_weights, bos_token_id=bos, eos_token_id=eos,
            architectures=[arch], dtype=dtype_name,
        )
        return cfg
    if m.family == "gpt":
        arch = "GPT2LMHeadModel"
        for field, expected in (("normalization", "LayerNorm"), ("gated_linear_unit", False), ("activation", "gelu"),
                                ("position_embedding_type", "learned_absolute"), ("add_bias_linear", True),
                                ("add_qkv_bias", True)):
            _require(m, field, expected, arch)
        if (m.num_query_groups or heads) != heads:
            raise ConversionError(f"model.num_query_groups={m.num_query_groups}: GPT2LMHeadModel has no GQA")
        if head_dim * heads != m.hidden_size:
            raise ConversionError(f"model.kv_channels={m.kv_channels}: GPT2LMHeadModel needs heads × head_dim = hidden")
        return GPT2Config(
            vocab_size=vocab, n_positions=m.seq_length, n_embd=m.hidden_size, n_layer=m.num_layers, n_head=heads,
            n_inner=ffn, activation_function="gelu",  # exact erf GELU, as Megatron's F.gelu
            resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout,
            layer_norm_epsilon=m.layernorm_epsilon, tie_word_embeddings=m.share_embeddings_and_output_weights,
            bos_token_id=bos, eos_token_id=eos, architectures=[arch], dtype=dtype_name,
        )
    raise ConversionError(f"model.family '{m.family}' has no HF mapping")


def config_json(cfg) -> dict:
    """config.json content: the transformers config plus the pre-v5 `rope_theta`/`rope_scaling` keys."""
    out = cfg.to_diff_dict()
    rope = out.get("rope_parameters")
    if cfg.model_type == "llama" and isinstance(rope, dict):
        out["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type") == "llama3":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def model_fields_from_hf(cfg) -> dict:
    """Our `model.*` fields for a transformers config (LlamaConfig / GPT2Config)."""
    archs = list(getattr(cfg, "architectures", None) or [])
    if cfg.model_type == "llama":
        if cfg.hidden_act != "silu":
            raise ConversionError(f"config.json: hidden_act={cfg.hidden_act!r}; only 'silu' (SwiGLU) is supported")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise ConversionError("config.json: attention_bias/mlp_bias are not supported for the llama family")
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        rtype = rope.get("rope_type", "default")
        fields = {}
        if rtype == "llama3":
            for key, want in LLAMA3_ROPE.items():
                if float(rope.get(key, want)) != float(want):
                    raise ConversionError(f"config.json: rope_scaling.{key}={rope.get(key)} (Megatron uses {want})")
            fields = {"rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
        elif rtype != "default":
            raise ConversionError(f"config.json: rope type {rtype!r} is not supported (default or llama3)")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return {
            "family": "llama", "normalization": "RMSNorm", "gated_linear_unit": True, "activation": "silu",
            "position_embedding_type": "rope", "add_bias_linear": False, "add_qkv_bias": False,
            "num_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "ffn_hidden_size": cfg.intermediate_size, "num_attention_heads": heads,
            "num_query_groups": cfg.num_key_value_heads or heads,
            "kv_channels": head_dim if head_dim * heads != cfg.hidden_size else None,
            "layernorm_epsilon": float(cfg.rms_norm_eps), "rotary_base": float(theta), "rope_scaling": False,
            "share_embeddings_and_output_weights": bool(cfg.tie_word_embeddings), "vocab_size": cfg.vocab_size,
            "seq_length": min(int(cfg.max_position_embeddings), 4096), "hidden_dropout": 0.0,
            "attention_dropout": float(getattr(cfg, "attention_dropout", 0.0)), **fields,
        }
    if cfg.model_type == "gpt2":
        return {
            "family": "gpt", "normalization": "LayerNorm", "gated_linear_unit": False, "activation": "gelu",
            "position_embedding_type": "learned_absolute", "add_bias_linear": True, "add_qkv_bias": True,
            "num_layers": cfg.n_layer, "hidden_size": cfg.n_embd, "ffn_hidden_size": cfg.n_inner or 4 * cfg.n_embd,
            "num_attention_heads": cfg.n_head, "num_query_groups": None, "kv_channels": None,
            "layernorm_epsilon": float(cfg.layer_norm_epsilon), "seq_length": cfg.n_positions,
            "share_embeddings_and_output_weights": bool(cfg.tie_word_embeddings), "vocab_size": cfg.vocab_size,
            "hidden_dropout": float(cfg.resid_pdrop), "attention_dropout": float(cfg.attn_pdrop),
        }
    raise ConversionError(f"config.json: model_type {cfg.model_type!r} ({', '.join(archs) or 'no architectures'}) "
                          "is not supported (llama, gpt2)")


def hf_parameter_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the transformers model's saved tensors (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = getattr(model, "_tied_weights_keys", None) or {}
    if cfg.tie_word_embeddings:
        for key in (tied if isinstance(tied, (list, dict, tuple, set)) else []):
            shapes.pop(key, None)
        shapes.pop("lm_head.weight", None)
    return shapes
