"""The causal depthwise 1-D convolution of Mamba-2 and Gated DeltaNet layers, in plain PyTorch (CPU and any device).

    y = causal_conv1d(x, weight, bias, activation="silu", seq_idx=seq_idx)

`x`: (batch, channels, seq); `weight`: (channels, width); `bias`: (channels,) or None; `activation`: "silu" /
"swish" or None; `seq_idx`: (batch, seq) integers, the document of each token (packed documents), or None. Output
(batch, channels, seq): y[b, d, t] = bias[d] + Σ_k weight[d, k] · x[b, d, t - (width - 1) + k], where a tap
reaching before the sequence or into another document (`seq_idx` differs) contributes nothing, so a packed batch
equals its documents convolved separately. This is what the `causal_conv1d` CUDA package computes
(`causal_conv1d_fn` with `seq_idx`); Megatron-Core's mixers call that package, which has no CPU build.

The sum is formed tap by tap in the same order with or without `seq_idx`, so a document gives the same bits alone
and packed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise convolution of `x` (see the module docstring)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation {activation!r} is not one of {ACTIVATIONS}")
    batch, channels, seq = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"causal_conv1d: weight {tuple(weight.shape)} does not match {channels} channels")
    if seq_idx is not None and tuple(seq_idx.shape) != (batch, seq):
        raise ValueError(f"causal_conv1d: seq_idx {tuple(seq_idx.shape)} is not (batch, seq) = ({batch}, {seq})")
    width = weight.shape[1]
    w = weight.to(x.dtype)
    padded = F.pad(x, (width - 1, 0))
    out = None
    for k in range(width):
        shift = width - 1 - k  # this tap reads the token `shift` positions back
        tap = padded[:, :, k:k + seq] * w[:, k:k + 1]
        if seq_idx is not None and shift:
            same = torch.zeros_like(seq_idx, dtype=torch.bool)
            same[:, shift:] = seq_idx[:, shift:] == seq_idx[:, :-shift]
            tap = tap * same[:, None, :].to(x.dtype)
        out = tap if out is None else out + tap
    if bias is not None:
        out = out + bias.to(x.dtype)[None, :, None]
    if activation is not None:
        out = F.silu(out)
    return out
