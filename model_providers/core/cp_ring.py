"""The p2p ring of context-parallel attention (`cp_comm_type: p2p`), as Transformer Engine runs it.

CP rank r keeps its queries; K/V blocks travel around the CP group (r sends to r+1, receives from r−1, CP−1
times), so at step i rank r attends to the block of rank r−i. Each step gives a partial output and its
log-sum-exp per query row; partial outputs are merged with log-sum-exp weights (rows with no allowed key in a block
contribute nothing). Send/recv have no autograd, so the backward is written out: the K/V blocks travel the same
ring again with their gradient accumulators (every rank adds its queries' share), and one more step brings each
accumulator home. Masks come from token placements (`model_providers.core.cp_layout`): causal order over global
positions, documents for THD, a sliding window over positions; a block with no allowed pair is skipped. Blocks
are computed in fp32; attention dropout masks are drawn per block (in the given RNG context) and kept for
backward.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from model_providers.core import cp_layout


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (softmax statistics and block merging); fp64 stays fp64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _start_exchange(send: torch.Tensor, group, rank: int) -> tuple[torch.Tensor, list]:
    """Post send to CP rank+1 and receive from CP rank−1 (global ranks of the group)."""
    ranks = dist.get_process_group_ranks(group)
    cp = len(ranks)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, ranks[(rank + 1) % cp], group),
           dist.P2POp(dist.irecv, recv, ranks[(rank - 1) % cp], group)]
    return recv, dist.batch_isend_irecv(ops)


def _finish(reqs: list) -> None:
    for req in reqs:
        req.wait()


def _expand(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[b, groups, s, d] → [b, heads, s, d] (each group serves `rep` consecutive heads)."""
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


def _fold(x: torch.Tensor, rep: int) -> torch.Tensor:
    """Gradient of `_expand`: sum the heads of each group."""
    if rep == 1:
        return x
    b, heads, s, d = x.shape
    return x.view(b, heads // rep, rep, s, d).sum(dim=2)


def _probs(q: torch.Tensor, k: torch.Tensor, ok: torch.Tensor, scale: float, lse: torch.Tensor | None):
    """(probabilities, log-sum-exp) of one block; `lse` given: normalise by it (backward), else by the block's."""
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~ok, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    probs = torch.where(ok, torch.exp(scores - lse.unsqueeze(-1)), 0.0)
    return probs, lse


def _weight(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """exp(a − b), 0 where both are −inf."""
    return torch.exp(a - b).nan_to_num(0.0).unsqueeze(-1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, places, rank, group, scale, causal, dropout_p, rng_fork, window):
        dtype = q.dtype
        qf = _wide(q.permute(1, 2, 0, 3))  # [b, heads, s, d]
        kv = _wide(torch.stack([k, v]).permute(0, 2, 3, 1, 4)).contiguous()  # [2, b, groups, s, d]
        rep = qf.shape[1] // kv.shape[2]
        cp = len(places)
        out = torch.zeros_like(qf)
        lse = torch.full(qf.shape[:-1], float("-inf"), dtype=qf.dtype, device=qf.device)
        masks: list[torch.Tensor | None] = []
        for i in range(cp):
            nxt, reqs = _start_exchange(kv, group, rank) if i < cp - 1 else (None, [])
            ok = cp_layout.allowed(places[rank], places[(rank - i) % cp], causal, window)
            mask = None
            if bool(ok.any()):
                probs, lse_block = _probs(qf, _expand(kv[0], rep), ok, scale, None)
                if dropout_p > 0:
                    with rng_fork() if rng_fork is not None else contextlib.nullcontext():
                        mask = torch.empty_like(probs).bernoulli_(1.0 - dropout_p)
                    probs = probs * mask / (1.0 - dropout_p)
                merged = torch.logaddexp(lse, lse_block)
                out = out * _weight(lse, merged) + (probs @ _expand(kv[1], rep)) * _weight(lse_block, merged)
                lse = merged
            masks.append(mask)
            _finish(reqs)
            if nxt is not None:
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.places, ctx.rank, ctx.group, ctx.scale, ctx.causal = places, rank, group, scale, causal
        ctx.window = window
        ctx.dropout_p, ctx.masks = dropout_p, masks
        return out.to(dtype).permute(2, 0, 1, 3)  # [s, b, heads, d]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        places, rank, group, scale, p = ctx.places, ctx.rank, ctx.group, ctx.scale, ctx.dropout_p
        cp = len(places)
        qf = _wide(q.permute(1, 2, 0, 3))
        do = _wide(dout.permute(1, 2, 0, 3))
        delta = (do * out).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O), also right under dropout
        kv = _wide(torch.stack([k, v]).permute(0, 2, 3, 1, 4)).contiguous()
        rep = qf.shape[1] // kv.shape[2]
        dq = torch.zeros_like(qf)
        dkv = torch.zeros_like(kv)
        for i in range(cp):
            ok = cp_layout.allowed(places[rank], places[(rank - i) % cp], ctx.causal, ctx.window)
            if bool(ok.any()):
                kb, vb = _expand(kv[0], rep), _expand(kv[1], rep)
                probs, _ = _probs(qf, kb, ok, scale, lse)
                mask = ctx.masks[i]
                kept = probs if mask is None else probs * mask / (1.0 - p)
                dprobs = do @ vb.transpose(-1, -2)
                if mask is not None:
                    dprobs = dprobs * mask / (1.0 - p)
                dscores = probs * (dprobs - delta)
                dq += (dscores @ kb) * scale
                dkv[0] += _fold((dscores.transpose(-1, -2) @ qf) * scale, rep)
                dkv[1] += _fold(kept.transpose(-1, -2) @ do, rep)
            if cp == 1:
                break
            if i < cp - 1:  # the block and its accumulator go on to the next rank
                both, reqs = _start_exchange(torch.cat([kv, dkv]), group, rank)
                _finish(reqs)
                kv, dkv = both[:2], both[2:]
            else:  # every rank has added its share: the accumulator goes home
                dkv, reqs = _start_exchange(dkv.contiguous(), group, rank)
                _finish(reqs)
        dk = dkv[0].permute(2, 0, 1, 3).to(k.dtype)
        dv = dkv[1].permute(2, 0, 1, 3).to(v.dtype)
        return dq.permute(2, 0, 1, 3).to(q.dtype), dk, dv, None, None, None, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, places: list, rank: int, group,
                   scale: float, causal: bool, dropout_p: float = 0.0, rng_fork=None,
                   window: int | None = None) -> torch.Tensor:
    """q [s, b, heads, d], k/v [s, b, groups, d] of this CP rank; `places[j]`: CP rank j's token placement;
    `window`: the left sliding-window size (None: none). Returns [s, b, heads, d]."""
    return _RingAttention.apply(q, k, v, places, rank, group, scale, causal, dropout_p, rng_fork, window)
