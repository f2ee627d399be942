"""How microbatches reach the model: packed documents (THD) and whether their length varies between
microbatches. One rule read by the builder (`TransformerConfig.variable_seq_lengths`) and by validation
(what Megatron-Core refuses with it). No torch import."""

from __future__ import annotations

from typing import Any


def packed_sequences(d: Any) -> bool:
    """Microbatches are packed documents in THD form (`PackedSeqParams`): with data.reset_attention_mask (of the
    data section `d`)."""
    return bool(d.reset_attention_mask)


def variable_seq_lengths(d: Any, layout: Any) -> bool:
    """Pipeline stages exchange tensor shapes before each tensor (Megatron's `variable_seq_lengths`): packed
    documents (data section `d`) under context parallelism are padded per microbatch, so their length varies."""
    return shapes_vary(packed_sequences(d), layout)


def shapes_vary(packed: bool, layout: Any) -> bool:
    """`variable_seq_lengths` of packed documents (`packed`) on `layout`: under CP × PP."""
    return packed and layout.cp > 1 and layout.pp > 1
