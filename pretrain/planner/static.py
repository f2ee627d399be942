"""Weights, gradients and optimizer state of one rank, from Megatron-Core DDP's buffer layout."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pretrain.config import Config
from pretrain.layout import Layout
from pretrain.planner.census import Param, chunk_parameters
from pretrain.planner.precision import fp8_params as has_fp8_params
from pretrain.planner.precision import weight_copy_bytes


@dataclass
class Buffer:
    """A simulated DDP `_ParamAndGradBuffer`: total elements, buckets, and each parameter's range."""

    numel: int
    buckets: list[tuple[int, int]]
    ranges: list[tuple[int, int, int]]  # (start, end, bucket) per parameter, in buffer order


def ddp_buffer(params: list[Param], dp_cp: int, distributed: bool, bucket_size: int | None) -> Buffer:
    """Megatron-Core's buffer layout: parameters in reverse order; with the distributed optimizer each
    parameter starts 64-element aligned and each bucket ends on a multiple of lcm(DP×CP, 128)."""

    def pad(n: int, k: int) -> int:
        return -(-n // k) * k

    bucket_div = math.lcm(dp_cp, 128)
    buckets: list[tuple[int, int]] = []
    ranges: list[tuple[int, int, int]] = []
    start = bucket_start = 0
    end = 0
    in_bucket = 0

    def close(end_index: int) -> int:
        nonlocal bucket_start, in_bucket
        bucket_end = pad(end_index, bucket_div) if distributed else end_index
        buckets.append((bucket_start, bucket_end))
        bucket_start, in_bucket = bucket_end, 0
        return bucket_end

    for p in reversed(params):
        if distributed:
            start = pad(start, 64)
        own_bucket = p.shared_embedding and distributed
        if own_bucket and in_bucket:
            start = close(start)
        end = start + p.numel
        ranges.append((start, end, len(buckets)))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    total = buckets[-1][1] if buckets else 0
    return Buffer(total, buckets, ranges)


def optimizer_elements(buf: Buffer, dp_cp: int, distributed: bool) -> list[int]:
    """Elements of optimizer state held by each data-parallel rank for one buffer."""
    real = sum(e - s for s, e, _ in buf.ranges)
    if not distributed:
        return [real] * dp_cp
    per_rank = [0] * dp_cp
    for s, e, b in buf.ranges:
        b_start, b_end = buf.buckets[b]
        shard = (b_end - b_start) // dp_cp
        if shard == 0 or e <= s:
            continue
        # Only the ranks whose shard [b_start + r·shard, b_start + (r + 1)·shard) meets [s, e).
        first = max(0, (s - b_start) // shard)
        last = min(dp_cp - 1, (e - 1 - b_start) // shard)
        for r in range(first, last + 1):
            lo, hi = b_start + r * shard, b_start + (r + 1) * shard
            per_rank[r] += max(0, min(e, hi) - max(s, lo))
    return per_rank


@dataclass
class StaticMemory:
    """Bytes of weights, gradients and optimizer state on one rank (all of its chunks)."""

    params: int  # parameter elements (unpadded)
    expert_params: int  # of which MoE expert weights
    weights: int
    gradients: int
    optimizer_moments: int
    optimizer_main_params: int
    fp8: int
    largest_param: int

    @property
    def optimizer(self) -> int:
        return self.optimizer_moments + self.optimizer_main_params


_CACHE: dict[tuple, StaticMemory] = {}  # the search plans one layout at several batch sizes and recompute settings


def _key(cfg: Config, lay: Layout, *rest) -> tuple:
    """What static memory depends on: the model but its recompute settings, DDP's options, the layout but batch."""
    values = ((f.name, getattr(cfg.model, f.name)) for f in dataclasses.fields(cfg.model))
    model = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in values if not k.startswith("recompute"))
    o = cfg.optimizer
    return (model, o.overlap_grad_reduce, o.grad_reduce_in_fp32, o.name, o.muon.layer_wise,
            dataclasses.replace(lay, mbs=1, gbs=1), *rest)


def static_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int,
                  dp_rank: int | None = None, edp_rank: int | None = None, gpu: str | None = None) -> StaticMemory:
    """Weights, gradient buffers and optimizer state of one rank (memoised `_static_memory`); `gpu`: the GPU kind
    (its FP8 GEMM layouts decide TE's FP8 transposes, `planner.precision`; None: Hopper's)."""
    key = _key(cfg, lay, padded_vocab, pp_rank, dp_rank, edp_rank, gpu)
    if key not in _CACHE:
        if len(_CACHE) > 4096:
            _CACHE.clear()
        _CACHE[key] = _static_memory(cfg, lay, padded_vocab, pp_rank, dp_rank, edp_rank, gpu)
    return _CACHE[key]


def _static_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int,
                   dp_rank: int | None = None, edp_rank: int | None = None, gpu: str | None = None) -> StaticMemory:
    """Weights, gradient buffers and optimizer state of one rank, as Megatron-Core allocates them.

    MoE expert weights live in their own DDP buffers, reduced (and with the distributed optimizer sharded) over
    expert data parallel (`lay.edp`) instead of data × context parallel. dp_rank / edp_rank None: the rank
    holding the most optimizer state.
    """
    o = cfg.optimizer
    dp_cp = lay.dp * lay.cp
    pbytes = lay.bytes_per_value
    fp8_params = has_fp8_params(cfg.model, lay)
    copy_bytes = weight_copy_bytes(cfg.model, cfg.performance, lay, gpu)  # TE's FP8 / NVFP4 copies beside a weight
    params = expert_params = weights = grads = 0
    fp8 = largest = 0
    opt_per_rank = {False: [0] * dp_cp, True: [0] * lay.edp}  # dense / expert optimizer shards
    for vp_stage in range(lay.vp):
        chunk = chunk_parameters(cfg.model, lay, padded_vocab, pp_rank, vp_stage)
        # DDP keeps one buffer per parameter dtype (FP8 parameters, uint8, apart) and expert-parallel kind.
        for expert in (False, True):
            group_dp = lay.edp if expert else dp_cp
            bucket_size = None
            if o.overlap_grad_reduce and vp_stage == 0 and pp_rank == 0:
                bucket_size = max(40_000_000, 1_000_000 * dp_cp)  # one DDP setting, from the dense group
            kind = [p for p in chunk if p.expert == expert]
            groups = [[p for p in kind if not (fp8_params and p.linear)], [p for p in kind if fp8_params and p.linear]]
            for group, elem in zip(groups, (pbytes, 1)):
                if not group:
                    continue
                buf = ddp_buffer(group, group_dp, lay.distributed, bucket_size)
                n = sum(p.numel for p in group)
                params += n
                expert_params += n if expert else 0
                weights += (buf.numel if lay.distributed else n) * elem
                grads += buf.numel * (4 if o.grad_reduce_in_fp32 else pbytes)  # FP8 params: bf16 grads
                for r, k in enumerate(optimizer_elements(buf, group_dp, lay.distributed)):
                    opt_per_rank[expert][r] += k
                largest = max(largest, max(p.numel for p in group))
        fp8 += int(sum(p.numel for p in chunk if p.linear) * copy_bytes)
    opt = max(opt_per_rank[False]) if dp_rank is None else opt_per_rank[False][dp_rank]
    opt += max(opt_per_rank[True]) if edp_rank is None else opt_per_rank[True][edp_rank]
    main = opt * 4 if lay.precision in ("bf16", "fp16") else 0
    opt *= 8
    if o.name == "muon":  # one momentum buffer per Muon element, AdamW's two moments for the rest
        from pretrain.planner.muon import muon_memory

        mu = muon_memory(cfg, lay, padded_vocab, pp_rank, dp_rank, edp_rank)
        opt, main = mu.momentum + mu.moments, mu.main_params
    return StaticMemory(params=params, expert_params=expert_params, weights=weights, gradients=grads,
                        optimizer_moments=opt, optimizer_main_params=main, fp8=fp8, largest_param=largest)
