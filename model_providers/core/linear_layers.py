"""Which decoder layers are Gated DeltaNet (linear attention) and which full attention: Megatron-Core's
`linear_attention_freq` rule, without torch (read by the family mapping, validation, the planner and the layer
specs)."""

from __future__ import annotations

VARIANT = "gated_delta_net"  # Megatron-Core's experimental_attention_variant of Gated DeltaNet


def linear_pattern(num_layers: int, freq) -> list[int]:
    """1 for a Gated DeltaNet layer, 0 for full attention, per layer (Megatron-Core's `linear_attention_freq`: N → every
    N-th layer full; a list as given; None: no linear layer)."""
    if freq is None:
        return [0] * num_layers
    if isinstance(freq, int):
        return [0 if (i + 1) % freq == 0 else 1 for i in range(num_layers)]
    return [int(x) for x in freq]


def has_linear_attention(m) -> bool:
    """A model (our ModelConfig or Megatron-Core's TransformerConfig) with Gated DeltaNet layers."""
    return getattr(m, "experimental_attention_variant", None) == VARIANT
