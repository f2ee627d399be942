"""Sliding-window attention: the one owner of what `model.sliding_window` and `model.window_attn_skip_freq` mean.

`model.sliding_window = W` has transformers' meaning (Mistral, Qwen2, GPT-OSS: `kv_idx > q_idx - W`): a token
attends to itself and the W − 1 tokens before it. Megatron-Core's `window_size = (left, right)` lets query i see
keys i − left … i + right (its `get_sliding_window_causal_mask`, Transformer Engine's convention), so W becomes
`(W − 1, 0)`. `model.window_attn_skip_freq` is Megatron-Core's: None, every layer windowed; N, every N-th layer
(1-based layer number divisible by N) full and the others windowed; a list, 1 = windowed per layer.

The window is passed to Megatron-Core only when it changes attention: when it is shorter than the training length
(`model.seq_length`; a packed document is never longer). A window covering the whole sequence is full causal
attention, the same numbers, and keeps Transformer Engine's backend choice (and its CP comm types) unrestricted.
No torch import.
"""

from __future__ import annotations

from typing import Any


def window_size(m: Any) -> tuple[int, int] | None:
    """Megatron-Core's `window_size` for the model config `m`: `(sliding_window − 1, 0)`, or None (no window, or one
    covering `seq_length`)."""
    w = getattr(m, "sliding_window", None)
    if w is None or w < 1 or m.seq_length <= w:
        return None
    return (w - 1, 0)


def skip_freq(m: Any) -> int | list[int] | None:
    """Megatron-Core's `window_attn_skip_freq` (a copy of a list), None without an effective window."""
    freq = getattr(m, "window_attn_skip_freq", None)
    if window_size(m) is None or freq is None:
        return None
    return list(freq) if isinstance(freq, (list, tuple)) else int(freq)


def layer_windowed(freq: int | list[int] | None, layer_number: int) -> bool:
    """Whether 1-based decoder layer `layer_number` uses the window (Megatron-Core's `is_layer_window_attention`
    rule), given a window exists."""
    if freq is None:
        return True
    if isinstance(freq, int):
        return layer_number % freq != 0
    return bool(freq[layer_number - 1])


def windowed_layers(m: Any) -> list[bool]:
    """Per decoder layer: attention is windowed (False everywhere without an effective window)."""
    if window_size(m) is None:
        return [False] * m.num_layers
    return [layer_windowed(skip_freq(m), i + 1) for i in range(m.num_layers)]


def mean_attended_keys(m: Any) -> float:
    """Keys a query attends to, averaged over queries and decoder layers, in Megatron's causal accounting (the
    (query, key) pairs less half the diagonal, s²/2 for a full layer): s/2 for a full layer; on a window W < s,
    (Σᵢ min(i + 1, W) − s/2)/s = W − W(W − 1)/(2s) − 1/2, which is s/2 at W = s. The FLOPs of the score and
    attention-value GEMMs follow it (`pretrain/observe/flops.py`)."""
    s = m.seq_length
    size = window_size(m)
    if size is None:
        return s / 2
    w = size[0] + 1
    windowed = sum(windowed_layers(m))
    keys = w - w * (w - 1) / (2 * s) - 0.5
    return (windowed * keys + (m.num_layers - windowed) * s / 2) / m.num_layers
