"""The hybrid layer pattern of Megatron-Core's `MambaModel` (`model.hybrid_layer_pattern`) and the Mamba-2 mixer's
derived sizes: one owner for the symbols, the counts and the shapes that validation, the builder, the HF mapping
and the planner read. No torch import.

A pattern has one symbol per layer, Megatron-Core's: `M` a Mamba-2 layer (norm → mixer), `*` an attention layer
(norm → self-attention), `-` an MLP layer (norm → MLP), `E` an MoE layer (norm → router and experts). Every layer is
one residual block, so `model.num_layers` is the pattern's length.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
SYMBOLS = {MAMBA: "Mamba-2", ATTENTION: "attention", MLP: "MLP", MOE: "MoE"}


def is_hybrid(m: Any) -> bool:
    """A model built as Megatron-Core's `MambaModel` (a hybrid layer pattern is set)."""
    return getattr(m, "hybrid_layer_pattern", None) is not None


def pattern_problem(pattern: str, num_layers: int) -> str | None:
    """Why `pattern` cannot be a pattern of `num_layers` layers (None when it can)."""
    unknown = sorted({c for c in pattern if c not in SYMBOLS})
    if unknown:
        known = ", ".join(f"{k} ({v})" for k, v in SYMBOLS.items())
        return f"has the unknown symbol(s) {' '.join(repr(c) for c in unknown)} (known: {known})"
    if len(pattern) != num_layers:
        return f"has {len(pattern)} symbols but model.num_layers={num_layers} (one symbol per layer)"
    return None


def counts(m: Any) -> Counter:
    """How many layers of each symbol the model's decoder has (the MTP depths' are `mtp_counts`)."""
    return Counter(m.hybrid_layer_pattern or "")


def mtp_pattern(m: Any) -> str:
    """The layers of one Multi-Token Prediction depth (`model.mtp_layer_pattern`; "" without MTP)."""
    return (getattr(m, "mtp_layer_pattern", None) or "") if getattr(m, "mtp_num_layers", None) else ""


def mtp_counts(m: Any) -> Counter:
    """How many layers of each symbol the MTP depths have together (the depth's pattern × model.mtp_num_layers)."""
    one = Counter(mtp_pattern(m))
    return Counter({k: v * m.mtp_num_layers for k, v in one.items()})


def unified_pattern(m: Any, segments: list[str] | None = None) -> str:
    """Megatron-Core 0.19's unified hybrid pattern: the decoder's layers, `|` between pipeline segments (one per
    model chunk, in Megatron-Core's order: virtual stage by virtual stage, pipeline rank by rank), then `/` and the
    MTP depth's pattern once per depth (`HybridModel(hybrid_layer_pattern=...)`, `parse_hybrid_pattern`)."""
    main = "|".join(segments) if segments else m.hybrid_layer_pattern
    depth = mtp_pattern(m)
    return main + "".join("/" + depth for _ in range(m.mtp_num_layers or 0)) if depth else main


def mamba_num_heads(m: Any) -> int:
    """Mamba heads: model.mamba_num_heads, else Megatron-Core's default 2 × hidden / head_dim."""
    return m.mamba_num_heads or 2 * m.hidden_size // m.mamba_head_dim


def mamba_inner(m: Any) -> int:
    """The mixer's inner width (heads × head_dim: z, x and the gated norm)."""
    return mamba_num_heads(m) * m.mamba_head_dim


def in_proj_parts(m: Any) -> dict[str, int]:
    """The rows of the fused input projection, in Megatron-Core's (and transformers') order: z, x, B, C, dt. Each
    part is split over TP on its own (a rank holds [z_r, x_r, B_r, C_r, dt_r]); checkpoints store one key per part."""
    inner, bc = mamba_inner(m), m.mamba_num_groups * m.mamba_state_dim
    return {"z": inner, "x": inner, "B": bc, "C": bc, "dt": mamba_num_heads(m)}


def conv_parts(m: Any) -> dict[str, int]:
    """The channels of the causal convolution: x, B, C (split over TP part by part, like the input projection)."""
    parts = in_proj_parts(m)
    return {k: parts[k] for k in ("x", "B", "C")}


def flops_per_token(m: Any, padded_vocab: int) -> float:
    """Training FLOPs per token of a hybrid model, as Megatron-LM counts them (`num_floating_point_operations`'
    hybrid branch, the accounting of Megatron-Bridge's published TFLOP/s): 3 × the forward's GEMMs at 2 FLOPs per
    multiply-add, per layer kind —

    - Mamba-2: in_proj 2·h·(2·d_in + 2·G·N + H), the scan 7·d_in·N, out_proj 2·d_in·h, with Megatron-LM's
      d_in = 2·h (its convention, whatever H × head_dim is), G groups, N state, H heads;
    - attention: 4·h·(a·d/h)·(h + h·g/a + s/2) (projections and the causal scores);
    - MLP: 4·h·f (× 3/2 gated); MoE: 4·h·f_e·k + 4·h·f_s (× 3/2 gated), the router not counted; LatentMoE:
      the experts at the latent width, 4·l·f_e·k, plus its projections 4·h·l;
    - logits: 2·h·V;
    - Multi-Token Prediction (`model.mtp_layer_pattern` × `model.mtp_num_layers`): each depth's layers as above and
      another 2·h·V of logits (Megatron-Bridge's hybrid count; the depth's norms and its 2h → h projection are not
      counted).
    """
    h, s = m.hidden_size, m.seq_length
    a = m.num_attention_heads
    g, d = m.num_query_groups or a, m.kv_channels or h // a
    gated = 1.5 if m.gated_linear_unit else 1.0
    d_in = 2 * h
    mamba = 2 * h * (2 * d_in + 2 * m.mamba_num_groups * m.mamba_state_dim + mamba_num_heads(m)) \
        + 7 * d_in * m.mamba_state_dim + 2 * d_in * h
    attention = 4 * h * (a * d / h) * (h + h * g / a + s / 2)
    mlp = 4 * h * (m.ffn_hidden_size or 4 * h) * gated
    moe = 0.0
    if m.num_moe_experts:
        latent = getattr(m, "moe_latent_size", None)  # LatentMoE: experts at the latent width, and its projections
        moe = 4 * (latent or h) * (m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * h) * m.moe_router_topk * gated
        moe += 4 * h * latent if latent else 0
        moe += 4 * h * (m.moe_shared_expert_intermediate_size or 0) * gated
    n = counts(m) + mtp_counts(m)
    logits = 2 * h * padded_vocab * (1 + (m.mtp_num_layers if mtp_pattern(m) else 0))
    forward = n[MAMBA] * mamba + n[ATTENTION] * attention + n[MLP] * mlp + n[MOE] * moe + logits
    return 3.0 * forward
