"""The causal depthwise 1-D convolution of the linear-attention and state-space mixers, in plain torch (the CUDA
kernels of the `causal_conv1d` package and flash-linear-attention do not exist on CPU).

`causal_conv1d(x, weight, bias, activation, seq_idx)`: x (batch, channels, seq), weight (channels, width), bias
(channels,) or None. Output position t of channel c is

    act(bias[c] + sum_j weight[c, j] · x[c, t - (width - 1) + j])

over the taps j whose input position is at least 0 and, with `seq_idx` (batch, seq: the document index of every token
of packed documents), in the same document as t: no tap reads across a document boundary, so a packed sequence gives
each document what it gives alone. This is the `causal_conv1d_fn(x, weight, bias, seq_idx, activation)` of the
`causal_conv1d` package and transformers' `causal_conv1d_fn` (`padding=width-1`, the first `seq` outputs); the taps are
summed in one fixed order whether or not `seq_idx` is given, so a document alone and packed are bit-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise convolution of `x` (b, d, s) with `weight` (d, w): (b, d, s), see the module doc."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of {ACTIVATIONS}")
    batch, channels, seq = x.shape
    if weight.shape[0] != channels:
        raise ValueError(f"causal_conv1d: weight has {weight.shape[0]} channels, x has {channels}")
    width = weight.shape[1]
    x = x.to(weight.dtype)
    out = None
    for j in range(width):
        shift = width - 1 - j  # this tap reads x[t - shift]
        if shift >= seq:
            continue
        tap = F.pad(x[..., :seq - shift], (shift, 0)) if shift else x
        if seq_idx is not None and shift:
            same = torch.zeros_like(seq_idx, dtype=torch.bool)
            same[:, shift:] = seq_idx[:, shift:] == seq_idx[:, :-shift]
            tap = tap * same.unsqueeze(1).to(tap.dtype)
        term = tap * weight[:, j].view(1, channels, 1)
        out = term if out is None else out + term
    if bias is not None:
        out = out + bias.view(1, channels, 1)
    if activation is not None:
        out = F.silu(out)
    return out
