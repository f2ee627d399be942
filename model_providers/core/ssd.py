"""Mamba-2's chunked state-space-duality (SSD) scan and its gated group RMSNorm, in plain PyTorch.

    y = ssd_scan(x, dt, A, B, C, chunk_size, D=D, z=z, seq_idx=seq_idx)
    y = gated_rms_norm(y, weight, group_size, eps)

These are what Megatron-Core's `MambaMixer` gets from the `mamba_ssm` Triton kernels (`mamba_split_conv1d_scan_combined`
after the convolution: the scan with the `D` skip and the `silu(z)` gate; then `RMSNormGated` by groups), which
have no CPU build. Shapes: `x` (batch, seq, heads, head_dim); `dt` (batch, seq, heads), already `softplus(dt +
dt_bias)`; `A` (heads,) negative; `B`, `C` (batch, seq, groups, state), each group shared by heads/groups
consecutive heads; `D` (heads,); `z` (batch, seq, heads, head_dim) or None; `seq_idx` (batch, seq) the document of
each token, or None.

The recurrence per head is h_t = exp(A·dt_t) h_{t-1} + dt_t B_t x_tᵀ, y_t = C_t h_t + D x_t, with the state set to
zero at the first token of every document (`seq_idx` changes), so a packed batch equals its documents run
separately. It is computed by chunks of `chunk_size` tokens like the kernels: inside a chunk as a masked
(C Bᵀ ∘ decay) product, across chunks by passing each chunk's final state on (one chunk after another). Decays are
exp of differences of the running sum of A·dt, as the kernels form them. Everything runs in fp32 (fp64 inputs in fp64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _chunks(t: torch.Tensor, pad: int, size: int) -> torch.Tensor:
    """(batch, seq, ...) → (batch, chunks, size, ...), zero-padded at the end."""
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], -1, size, *t.shape[2:])


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk_size: int,
             D: torch.Tensor | None = None, z: torch.Tensor | None = None,
             seq_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The SSD scan (module docstring); returns (batch, seq, heads, head_dim) in fp32 (fp64 for fp64 inputs)."""
    batch, seq, heads, head_dim = x.shape
    groups = B.shape[2]
    if heads % groups:
        raise ValueError(f"ssd_scan: {heads} heads do not split into {groups} groups")
    work = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 inputs stay fp64)
    x, dt, A = x.to(work), dt.to(work), A.to(work)
    B = B.to(work).repeat_interleave(heads // groups, dim=2)
    C = C.to(work).repeat_interleave(heads // groups, dim=2)
    pad = -seq % chunk_size
    xdt = _chunks(x * dt[..., None], pad, chunk_size)  # (b, c, l, h, p)
    Bc, Cc = _chunks(B, pad, chunk_size), _chunks(C, pad, chunk_size)  # (b, c, l, h, n)
    acum = _chunks(dt * A, pad, chunk_size).cumsum(dim=2)  # (b, c, l, h): running log-decay inside each chunk
    nchunks = xdt.shape[1]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    if seq_idx is not None:
        sid = _chunks(seq_idx[..., None], pad, chunk_size)[..., 0]  # padding joins document 0; it carries no input
        if pad:
            sid[:, -1, chunk_size - pad:] = sid[:, -1, chunk_size - pad - 1:chunk_size - pad]
        last = sid[:, :, -1]  # (b, c): the document of each chunk's last token
        same = causal[None, None] & (sid[:, :, :, None] == sid[:, :, None, :])  # (b, c, l, s)
    else:
        same = causal[None, None].expand(batch, nchunks, -1, -1)
    # 1. inside each chunk: y_l = Σ_{s ≤ l, same document} (C_l·B_s) exp(acum_l - acum_s) x_s dt_s
    diff = acum[:, :, :, None, :] - acum[:, :, None, :, :]  # (b, c, l, s, h)
    decay = torch.exp(diff.masked_fill(~same[..., None], float("-inf")))
    scores = torch.einsum("bclhn,bcshn->bclsh", Cc, Bc) * decay
    y = torch.einsum("bclsh,bcshp->bclhp", scores, xdt)
    # 2. each chunk's contribution to the state at its end (tokens of the last token's document only)
    to_end = torch.exp(acum[:, :, -1:, :] - acum)  # (b, c, l, h)
    if seq_idx is not None:
        to_end = to_end * (sid == last[:, :, None])[..., None]
    local = torch.einsum("bclhn,bclh,bclhp->bchpn", Bc, to_end, xdt)
    # 3. the state entering each chunk, passed on chunk by chunk (zeroed where a document starts)
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    entering = []
    for c in range(nchunks):
        entering.append(state)
        carry = torch.exp(acum[:, c, -1, :])[:, :, None, None]  # (b, h, 1, 1)
        if seq_idx is not None and c:
            carry = carry * (last[:, c] == last[:, c - 1]).to(carry.dtype)[:, None, None, None]
        state = state * carry + local[:, c]
    entering = torch.stack(entering, dim=1)  # (b, c, h, p, n)
    # 4. the entering state read out: y_l += C_l · state exp(acum_l), for tokens of the previous chunk's document
    from_state = torch.exp(acum)  # (b, c, l, h)
    if seq_idx is not None:
        before = torch.cat([last[:, :1], last[:, :-1]], dim=1)  # chunk 0 enters with a zero state anyway
        from_state = from_state * (sid == before[:, :, None])[..., None]
    y = y + torch.einsum("bclhn,bchpn,bclh->bclhp", Cc, entering, from_state)
    y = y.reshape(batch, -1, heads, head_dim)[:, :seq]
    if D is not None:
        y = y + D.to(work)[:, None] * x
    if z is not None:
        y = y * F.silu(z.to(work))
    return y


def gated_rms_norm(y: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                   z: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over consecutive groups of `group_size` channels of the last dim, times `weight`; with `z`, of
    y·silu(z) (the gate before the norm: `mamba_ssm`'s `norm_before_gate=False`). Computed in fp32, returned in
    `y`'s dtype."""
    dtype = y.dtype
    work = torch.promote_types(dtype, torch.float32)
    h = y.to(work)
    if z is not None:
        h = h * F.silu(z.to(work))
    *lead, width = h.shape
    if width % group_size:
        raise ValueError(f"gated_rms_norm: {width} channels do not split into groups of {group_size}")
    g = h.reshape(*lead, width // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (g.reshape(*lead, width) * weight.to(work)).to(dtype)
