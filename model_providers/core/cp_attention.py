"""Core attention with context parallelism for the local spec (CPU, or a GPU without Transformer Engine).

Megatron-Core implements context parallelism only inside Transformer Engine's attention; its own
`DotProductAttention` refuses CP > 1 (`transformer/dot_product_attention.py:57-59`) and packed sequences. This
module is the `self_attention.submodules.core_attention` of the local spec when CP > 1 or when samples are packed
documents (THD, `PackedSeqParams`). It takes Megatron's constructor arguments and forward signature and Transformer
Engine's token order (2×CP zigzag chunks, per document for THD: `model_providers.core.cp_layout`), and implements
Megatron's `cp_comm_type` choices:

- `all_gather`: every rank gathers K and V of the whole sequence and attends its own queries to them;
- `a2a` (Ulysses): all-to-all from sequence-split to head-split Q, K, V, full-sequence attention on CP-th of the
  heads, all-to-all back (heads and query groups per TP rank divisible by CP);
- `p2p`: the ring of `model_providers.core.cp_ring` — K/V blocks passed around the CP group, partial results
  merged by their log-sum-exp, with a hand-written backward (send/recv have no autograd).

Attention sinks (`softmax_type` learnable or off-by-one: GPT-OSS): the parameter `softmax_offset` (one logit per head
of this TP rank, Megatron-Core's name, shape and checkpoint entry) joins every softmax row as one more column that is
dropped after it, with `all_gather` and `a2a` (whose CP rank takes its head group's sinks); the `p2p` ring merges
partial results by log-sum-exp with a hand-written backward that has no sink term, so validation refuses it.

Masks come from global token positions (causal), documents (THD) and the layer's sliding window (Megatron's
`window_size` / `window_attn_skip_freq`: `model_providers.core.windows`), for every comm type; the scale, GQA head
expansion, fp32 softmax and attention dropout (inside the tensor-parallel RNG fork unless sequence parallel)
follow `DotProductAttention`. The scores of a rank's queries against the whole sequence are materialised: s²/CP
per rank (a CPU reference, not a fast kernel). Collectives run through the autograd functions below
(torch.distributed.nn's fail on gloo subgroups whose ranks are not the global ranks).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from model_providers.core import cp_layout, windows
from model_providers.core.cp_ring import _wide, ring_attention

COMM_TYPES = ("p2p", "all_gather", "a2a")


class _AllGather(torch.autograd.Function):
    """Concatenate every CP rank's tensor along dim 0 (rank order); backward: sum the gradients, keep our slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        n, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=0)[rank].contiguous(), None


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its gradient is the same exchange in the other direction."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor, scale: float,
           dropout=None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`DotProductAttention`'s math under a boolean mask. q [sq, b, np, hn], k/v [sk, b, ng, hn], ok [sq, sk],
    sinks None or [np] (a logit per head joining each softmax row, then dropped: Megatron's `SoftmaxOne`);
    returns [sq, b, np, hn]. Rows with no allowed key (padding tokens of packed sequences) give 0."""
    sq, b, heads, hn = q.shape
    sk, groups = k.shape[0], k.shape[2]
    if heads // groups > 1:  # GQA: each query group serves heads/groups consecutive heads
        k = k.repeat_interleave(heads // groups, dim=2)
        v = v.repeat_interleave(heads // groups, dim=2)
    qf = q.reshape(sq, b * heads, hn).transpose(0, 1)
    kf = k.reshape(sk, b * heads, hn).transpose(0, 1)
    scores = torch.bmm(qf, kf.transpose(1, 2)) * scale  # [b·np, sq, sk]
    keep = ok.any(dim=-1)  # [sq]
    padded = not bool(keep.all())
    if padded:  # keep the softmax finite on those rows; their output is zeroed below
        ok = ok | ~keep[:, None]
    logits = _wide(scores).masked_fill(~ok, float("-inf"))
    if sinks is None:
        probs = torch.softmax(logits, dim=-1).to(q.dtype)  # fp32 softmax
    else:
        column = _wide(sinks).to(logits.device).repeat(b).view(b * heads, 1, 1).expand(-1, sq, 1)
        probs = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    if dropout is not None:
        probs = dropout(probs)
    vf = v.reshape(sk, b * heads, hn).transpose(0, 1)
    context = torch.bmm(probs, vf).view(b, heads, sq, hn).permute(2, 0, 1, 3)  # [sq, b, np, hn]
    return context.masked_fill(~keep[:, None, None, None], 0.0) if padded else context


class ContextParallelAttention(MegatronModule):
    """Core attention over a context-parallel group (and THD packed sequences), built like Megatron's
    `DotProductAttention`: `(config, layer_number, attn_mask_type, attention_type, cp_comm_type, softmax_scale,
    pg_collection)`; forward `(query, key, value, attention_mask, attn_mask_type=, attention_bias=,
    packed_seq_params=)` with q [s/CP, b, np, hn] (THD: [t/CP, np, hn]), returning [s/CP, b, np·hn] (THD: [t/CP,
    np·hn])."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 cp_comm_type: str | None = None, softmax_scale: float | None = None, pg_collection=None,
                 attention_dropout: float | None = None, **_unused):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type or "p2p"
        if self.cp_comm_type not in COMM_TYPES:
            raise ValueError(f"cp_comm_type {self.cp_comm_type!r} is not one of {', '.join(COMM_TYPES)} "
                             "(the local spec's context-parallel attention)")
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        if config.apply_query_key_layer_scaling:  # DotProductAttention divides, its fp16 softmax multiplies back
            raise ValueError("apply_query_key_layer_scaling is not supported by the context-parallel attention")
        size = getattr(config, "window_size", None)
        if size is not None and size[1] != 0:
            raise ValueError(f"window_size {tuple(size)}: the context-parallel attention takes causal windows "
                             "(right size 0)")
        layered = size is not None and windows.layer_windowed(config.window_attn_skip_freq, self.layer_number)
        self.window = int(size[0]) if layered else None  # keys at most this many positions back
        p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.attention_dropout = torch.nn.Dropout(p) if p > 0 else None
        self._sinks(config)

    def _sinks(self, config) -> None:
        """`softmax_offset` as Megatron-Core's `DotProductAttention` makes it (name, shape, dtype, checkpoint entry)."""
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type == "vanilla":
            self.softmax_offset = None
            return
        heads = config.num_attention_heads // parallel_state.get_tensor_model_parallel_world_size()
        if softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(heads, dtype=config.params_dtype)
        else:
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable sinks split over TP by heads, as `DotProductAttention` stores them."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        learnable = isinstance(self.softmax_offset, torch.nn.Parameter)
        state = self.state_dict(prefix="", keep_vars=True) if learnable else {}
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets)

    # ----------------------------------------------------------------------------------------------

    def _dropout(self, probs: torch.Tensor) -> torch.Tensor:
        if self.config.sequence_parallel:
            return self.attention_dropout(probs)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.attention_dropout(probs)

    def forward(self, query, key, value, attention_mask, attn_mask_type: AttnMaskType | None = None,
                attention_bias=None, packed_seq_params=None, **_unused):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the context-parallel attention")
        if attention_mask is not None:
            raise ValueError("the context-parallel attention takes causal or packed-sequence (THD) masks, not a "
                             "dense attention_mask (per-document masks travel as PackedSeqParams)")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        packed = packed_seq_params if thd else None
        if thd:  # [t, np, hn] -> [t, 1, np, hn]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        group = self.cp_group
        cp = dist.get_world_size(group) if group is not None else 1
        rank = dist.get_rank(group) if cp > 1 else 0
        n = query.shape[0]
        places = [cp_layout.placement(n, cp, r, packed, device=query.device) for r in range(cp)]
        dropout = self._dropout if self.attention_dropout is not None and self.training else None
        sinks = self.softmax_offset
        if cp == 1:
            ok = cp_layout.allowed(places[0], places[0], causal, self.window)
            out = attend(query, key, value, ok, self.softmax_scale, dropout, sinks)
        elif self.cp_comm_type == "all_gather":
            out = self._all_gather(query, key, value, places, rank, causal, dropout)
        elif self.cp_comm_type == "a2a":
            out = self._all_to_all(query, key, value, places, causal, dropout)
        else:
            if sinks is not None:
                raise ValueError("attention sinks (softmax_type) with cp_comm_type p2p: the ring has no sink term; "
                                 "use a2a or all_gather")
            p = self.attention_dropout.p if dropout is not None else 0.0
            out = ring_attention(query, key, value, places, rank, group, self.softmax_scale, causal, p,
                                 self._ring_rng(), self.window)
        out = out.reshape(out.shape[0], out.shape[1], -1)  # [s, b, np·hn]
        return out.squeeze(1) if thd else out

    def _ring_rng(self):
        """The context the ring draws its dropout masks in (DotProductAttention's choice)."""
        if self.config.sequence_parallel:
            return None
        return tensor_parallel.get_cuda_rng_tracker().fork

    def _all_gather(self, q, k, v, places, rank, causal, dropout):
        """Gather K and V of every rank (their tokens in rank order) and attend the local queries to them."""
        groups = k.shape[2]
        kv = _AllGather.apply(torch.cat([k, v], dim=2), self.cp_group)
        keys = cp_layout.TokenPlacement.cat(places)
        ok = cp_layout.allowed(places[rank], keys, causal, self.window)
        return attend(q, kv[:, :, :groups], kv[:, :, groups:], ok, self.softmax_scale, dropout, self.softmax_offset)

    def _all_to_all(self, q, k, v, places, causal, dropout):
        """Ulysses: sequence-split → head-split Q, K, V (all-to-all), full-sequence attention on heads/CP heads,
        head-split → sequence-split output."""
        cp = len(places)
        if q.shape[2] % cp or k.shape[2] % cp:
            raise ValueError(f"cp_comm_type a2a needs the attention heads ({q.shape[2]}) and query groups "
                             f"({k.shape[2]}) of a tensor-parallel rank divisible by CP={cp}")
        qkv = [self._heads_to_front(x, cp) for x in (q, k, v)]
        qkv = [_AllToAll.apply(x, self.cp_group).flatten(0, 1) for x in qkv]  # [cp·s, b, heads/cp, hn]
        everyone = cp_layout.TokenPlacement.cat(places)
        ok = cp_layout.allowed(everyone, everyone, causal, self.window)
        sinks = self.softmax_offset
        if sinks is not None:  # this CP rank attends with head group `rank` of this TP rank's heads
            per = q.shape[2] // cp
            sinks = sinks.narrow(0, dist.get_rank(self.cp_group) * per, per)
        out = attend(*qkv, ok, self.softmax_scale, dropout, sinks)  # [cp·s, b, np/cp, hn]
        s = q.shape[0]
        out = _AllToAll.apply(out.reshape(cp, s, *out.shape[1:]), self.cp_group)  # [cp (head group), s, b, ..]
        return out.permute(1, 2, 0, 3, 4).reshape(s, q.shape[1], q.shape[2], q.shape[3])

    @staticmethod
    def _heads_to_front(x: torch.Tensor, cp: int) -> torch.Tensor:
        """[s, b, h, d] → [cp, s, b, h/cp, d]: head group j goes to CP rank j."""
        s, b, h, d = x.shape
        return x.reshape(s, b, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
