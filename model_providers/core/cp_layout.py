"""Where each token of a context-parallel rank sits: the one owner of the chunk order.

Megatron-Core splits a sequence into 2×CP chunks and gives CP rank r chunks r and 2·CP−1−r
(`megatron.core.utils.get_batch_on_this_cp_rank`, which Transformer Engine's attention expects); packed
sequences in THD form (documents one after another, described by `cu_seqlens`) are split the same way one
document at a time (Transformer Engine's `thd_get_partitioned_indices`: every document padded to a multiple of
2×CP). `thd_partition_index` computes those indices in plain torch, so the data path (pretrain.data.datasets, which
slices a packed batch) and the CPU attention (model_providers.core.cp_attention, which masks by these positions)
agree by construction, on CPU and GPU.

`TokenPlacement` says, for each local token, which document it belongs to, its position in that document and
whether it is a real token (not padding): causal / per-document masks are built from placements alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def zigzag_positions(local_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of CP rank `rank`'s `local_len` tokens: chunks rank and 2·CP−1−rank of 2·CP."""
    if cp == 1:
        return torch.arange(local_len, device=device)
    if local_len % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; got {local_len} tokens")
    c = local_len // 2
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def thd_partition_index(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Indices into a packed (THD) sequence of CP rank `rank`'s tokens: for every document, its chunks rank and
    2·CP−1−rank of 2·CP (documents in order). The same indices as Transformer Engine's
    `tex.thd_get_partitioned_indices(cu_seqlens_padded, total, cp, rank)`; every padded length divisible by 2·CP
    (CP = 1: every token, unpadded)."""
    bounds = [int(x) for x in cu_seqlens_padded.tolist()]
    if cp == 1:
        return torch.arange(bounds[-1], device=cu_seqlens_padded.device)
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length % (2 * cp):
            raise ValueError(f"packed sequence of padded length {length} is not divisible by 2×CP = {2 * cp}")
        c = length // (2 * cp)
        pieces.append(torch.arange(start + rank * c, start + (rank + 1) * c))
        pieces.append(torch.arange(start + (2 * cp - 1 - rank) * c, start + (2 * cp - rank) * c))
    out = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return out.to(cu_seqlens_padded.device)


@dataclass(frozen=True)
class TokenPlacement:
    """Per local token: document index, position inside the document, real (not padding)."""

    doc: torch.Tensor  # int64 [n]
    pos: torch.Tensor  # int64 [n]
    valid: torch.Tensor  # bool [n]

    @staticmethod
    def cat(placements: list[TokenPlacement]) -> TokenPlacement:
        return TokenPlacement(torch.cat([p.doc for p in placements]), torch.cat([p.pos for p in placements]),
                              torch.cat([p.valid for p in placements]))


def placement(local_len: int, cp: int, rank: int, packed=None, device=None) -> TokenPlacement:
    """Where CP rank `rank`'s tokens sit. `packed`: Megatron-Core `PackedSeqParams` (THD), else one sequence."""
    if packed is None:
        pos = zigzag_positions(local_len, cp, rank, device=device)
        return TokenPlacement(torch.zeros_like(pos), pos, torch.ones_like(pos, dtype=torch.bool))
    padded = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
    padded = padded.to(device=device, dtype=torch.long)
    real = packed.cu_seqlens_q.to(device=device, dtype=torch.long)
    index = thd_partition_index(padded, cp, rank)
    if index.numel() != local_len:
        raise ValueError(f"packed sequence parameters describe {index.numel()} tokens on CP rank {rank}, "
                         f"the attention input holds {local_len}")
    doc = torch.searchsorted(padded, index, right=True) - 1
    pos = index - padded[doc]
    valid = pos < (real[1:] - real[:-1])[doc]
    return TokenPlacement(doc, pos, valid)


def allowed(q: TokenPlacement, k: TokenPlacement, causal: bool, window: int | None = None) -> torch.Tensor:
    """[len q, len k] bool: query may attend to key (same document, real key and query, causal order; `window`:
    Megatron's left window size, keys at most that many positions before the query)."""
    ok = (q.doc[:, None] == k.doc[None, :]) & k.valid[None, :] & q.valid[:, None]
    if causal:
        ok &= k.pos[None, :] <= q.pos[:, None]
    if window is not None:
        ok &= k.pos[None, :] >= q.pos[:, None] - window
    return ok
