"""Megatron-FSDP terms of the plan (optimizer.fsdp): what each rank holds and what it sends per step.

Megatron-FSDP keeps every parameter in flat buffers sharded over the data × context parallel group (experts over
expert data parallel), by strategy (`optimizer.fsdp_sharding`; megatron-core `megatron_fsdp.py`):

| strategy | weights (param dtype) | fp32 main weights (bf16/fp16) | gradients | Adam moments |
|---|---|---|---|---|
| optim_grads_params (ZeRO-3) | 1/n | 1/n | 1/n | 1/n |
| optim_grads (ZeRO-2) | whole | 1/n | 1/n | 1/n |

`preserve_fp32_weights` (on by default) keeps the fp32 main weights in their own sharded buffer; in fp32 the
model buffer is the fp32 one. The working set on top (the "unit" is one TransformerLayer, Megatron's
`fsdp_unit_modules`; the embedding and the output layer are gathered whole as the modules that use them):

- ZeRO-3: the all-gathered parameters of the unit in use and of the one prefetched (Megatron sizes its
  all-gather prefetch at one average unit), 2 × the largest unit × param bytes; and the unit's unsharded
  gradient with the one being reduce-scattered, 2 × the largest unit × gradient bytes;
- ZeRO-2: the unsharded gradients of two units before their reduce-scatter.

Communication per step, n = DP×CP (experts: EDP), M microbatches, P = this rank's parameters:
- ZeRO-3 all-gathers the parameters in every microbatch's forward and again in its backward (they are freed in
  between) and reduce-scatters the gradients after every microbatch's backward: M·(n−1)/n·P·(2·p + g) bytes;
- ZeRO-2 reduce-scatters every microbatch and all-gathers the updated parameters once: (n−1)/n·P·(M·g + p);
- the distributed optimizer, for comparison, reduce-scatters once and all-gathers once: (n−1)/n·P·(g + p).
Megatron-FSDP overlaps both with compute (it forces overlap on); the cost model, like the DDP one, adds them
without overlap (an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config import Config
from pretrain.layout import Layout
from pretrain.planner.census import chunk_parameters
from pretrain.planner.static import StaticMemory

_UNIT = "decoder.layers."


@dataclass
class FsdpMemory:
    """The sharded buffers (as StaticMemory) and the working set of gathered units, in bytes."""

    static: StaticMemory
    gathered_params: int  # all-gathered weights of the unit in use and the prefetched one
    unsharded_grads: int  # gradients of the units not reduce-scattered yet
    largest_unit: int  # elements of the largest unit (a layer, or the embedding / output layer)

    @property
    def working_set(self) -> int:
        return self.gathered_params + self.unsharded_grads


def _units(params, linear_only: bool = False) -> list[int]:
    """Elements per FSDP unit: each decoder layer, and each parameter outside them (gathered on its own)."""
    units: dict[str, int] = {}
    for p in params:
        if linear_only and not p.linear:
            continue
        key = p.name[: p.name.index(".", len(_UNIT)) + 1] if p.name.startswith(_UNIT) else p.name
        units[key] = units.get(key, 0) + p.numel
    return list(units.values())


def fsdp_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int) -> FsdpMemory:
    """Sharded weights, gradients and optimizer state of one rank, and the gathered working set."""
    zero3 = lay.fsdp_sharding == "optim_grads_params"
    n, pbytes = lay.dp * lay.cp, lay.bytes_per_value
    gbytes = 4 if cfg.optimizer.grad_reduce_in_fp32 else pbytes
    params = [p for vp in range(lay.vp) for p in chunk_parameters(cfg.model, lay, padded_vocab, pp_rank, vp)]
    dense = sum(p.numel for p in params if not p.expert)
    expert = sum(p.numel for p in params if p.expert)
    shard = -(-dense // n) + -(-expert // lay.edp)  # elements this rank owns
    total = dense + expert
    main = shard * 4 if lay.precision in ("bf16", "fp16") else 0
    # Transformer Engine FP8: the FP8 copy and transposed copy of the gathered unit's GEMM weights (ZeRO-3 drops
    # them with the unit; ZeRO-2 keeps every layer's, as DDP does).
    linear = _units(params, linear_only=True)
    fp8 = (2 * max(linear, default=0) if zero3 else 2 * sum(linear)) if cfg.model.fp8 and lay.use_te else 0
    static = StaticMemory(params=total, expert_params=expert, weights=(shard if zero3 else total) * pbytes,
                          gradients=shard * gbytes, optimizer_moments=shard * 8, optimizer_main_params=main,
                          fp8=fp8, largest_param=max((p.numel for p in params), default=0))
    unit = max(_units(params), default=0)
    return FsdpMemory(static=static, gathered_params=2 * unit * pbytes if zero3 else 0,
                      unsharded_grads=2 * unit * gbytes, largest_unit=unit)


def fsdp_comm_bytes(cfg: Config, lay: Layout, params: int, expert_params: int) -> tuple[float, float]:
    """(dense, expert) bytes one rank sends per step in Megatron-FSDP's all-gathers and reduce-scatters."""
    pbytes = lay.bytes_per_value
    gbytes = 4 if cfg.optimizer.grad_reduce_in_fp32 else pbytes
    m = lay.num_microbatches

    def volume(p: int, n: int) -> float:
        if n <= 1:
            return 0.0
        f = (n - 1) / n * p
        if lay.fsdp_sharding == "optim_grads_params":
            return m * f * (2 * pbytes + gbytes)
        return f * (m * gbytes + pbytes)

    return volume(params - expert_params, lay.dp * lay.cp), volume(expert_params, lay.edp)
