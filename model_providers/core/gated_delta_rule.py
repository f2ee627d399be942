"""The chunked gated delta rule of Gated DeltaNet without flash-linear-attention, with packed documents.

Megatron-Core's `torch_chunk_gated_delta_rule` (its deterministic-mode kernel, transformers' reference algorithm:
`megatron/core/ssm/gated_delta_net.py` in 0.16.1, `.../gated_delta_net/common.py` in 0.19.2) computes one sequence
per batch row from a zero state and takes no `cu_seqlens`. Packed documents (THD, one row: `PackedSeqParams`) are cut
at their boundaries here and each document runs from a zero state, which is what the FLA kernel does with
`cu_seqlens`: a packed sequence gives each document exactly what the document gives alone.

`l2norm` is FLA's (and transformers') `x · rsqrt(Σx² + 1e-6)` over the head dimension, applied to queries and keys
before the rule (`GatedDeltaNet.use_qk_l2norm`, with `use_qk_l2norm_in_kernel=False`, as Megatron-Core calls it).
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / ‖x‖ over the last dimension (FLA's `l2norm`: x · rsqrt(Σx² + eps))."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def document_bounds(packed_seq_params, seq_len: int) -> list[tuple[int, int]] | None:
    """The [start, end) of each packed document of a THD microbatch of `seq_len` tokens (the padded lengths, which
    Megatron-Core's GDN reads too), or None without packed documents."""
    if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
        return None
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    cu = [int(c) for c in cu.tolist()]
    if cu[-1] != seq_len:
        raise ValueError(f"packed documents cover {cu[-1]} tokens, the sequence has {seq_len}")
    return [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]


def seq_index(bounds: list[tuple[int, int]] | None, seq_len: int, device) -> torch.Tensor | None:
    """The document index of every token, [1, seq_len] (the `seq_idx` of `causal_conv1d`), or None."""
    if bounds is None:
        return None
    idx = torch.empty(seq_len, dtype=torch.int32, device=device)
    for n, (a, b) in enumerate(bounds):
        idx[a:b] = n
    return idx.unsqueeze(0)


def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     bounds: list[tuple[int, int]] | None = None, chunk_size: int = 64) -> torch.Tensor:
    """The gated delta rule over [batch, seq, heads, dim] queries/keys (already L2-normed, heads repeated to the value
    heads), values, log-decays g and write strengths beta ([batch, seq, heads]), from a zero state per row, or per
    document of `bounds` (one row). Returns [batch, seq, heads, value dim] in the queries' dtype."""
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    def rule(q, k, v, gg, bb):
        out, _ = torch_chunk_gated_delta_rule(q, k, v, g=gg, beta=bb, chunk_size=chunk_size, initial_state=None,
                                              output_final_state=False, use_qk_l2norm_in_kernel=False)
        return out

    if bounds is None:
        return rule(query, key, value, g, beta)
    if query.shape[0] != 1:
        raise ValueError(f"packed documents come in one row (THD), got {query.shape[0]}")
    parts = [rule(query[:, a:b], key[:, a:b], value[:, a:b], g[:, a:b], beta[:, a:b]) for a, b in bounds]
    return torch.cat(parts, dim=1)
