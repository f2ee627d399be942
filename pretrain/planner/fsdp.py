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

from pretrain.config import Config, OptimizerConfig
from pretrain.layout import Layout
from pretrain.planner.census import chunk_parameters
from pretrain.planner.precision import FP8_BYTES, TENSOR_SCALED, fp8_params, fp8_transposes, weight_copy_bytes
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


def _units(params, weight_bytes=None) -> list[int]:
    """Per FSDP unit (each decoder layer, and each parameter outside them, gathered on its own): its elements, or
    with `weight_bytes(param)` its bytes."""
    units: dict[str, int] = {}
    for p in params:
        key = p.name[: p.name.index(".", len(_UNIT)) + 1] if p.name.startswith(_UNIT) else p.name
        units[key] = units.get(key, 0) + (p.numel if weight_bytes is None else int(p.numel * weight_bytes(p)))
    return list(units.values())


def fsdp_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int, gpu: str | None = None) -> FsdpMemory:
    """Sharded weights, gradients and optimizer state of one rank, and the gathered working set.

    With FP8 parameters (`model.fp8_param_gather` under an FP8 recipe) Megatron-FSDP keeps the linear weights' buffers
    in uint8 (their gradients in bf16), sharded and gathered, and a second, column-wise buffer where the recipe needs
    one (MXFP8; megatron-core `megatron_fsdp/param_and_grad_buffer.py` `_init_each_parameter_group_buffers`:
    `param_dtype = torch.uint8`, `need_transpose_data`). Transformer Engine's copies beyond them (`planner.precision`:
    a transpose on Hopper; the FP8 copy of bf16 weights) are kept for the gathered unit (ZeRO-3: dropped with it, and
    Megatron-Bridge sets `keep_fp8_transpose_cache=False`) or for every layer (ZeRO-2, as DDP). `gpu`: the GPU kind."""
    zero3 = lay.fsdp_sharding == "optim_grads_params"
    n, pbytes = lay.dp * lay.cp, lay.bytes_per_value
    gbytes = 4 if cfg.optimizer.grad_reduce_in_fp32 else pbytes
    params = [p for vp in range(lay.vp) for p in chunk_parameters(cfg.model, lay, padded_vocab, pp_rank, vp)]
    dense = sum(p.numel for p in params if not p.expert)
    expert = sum(p.numel for p in params if p.expert)
    total = dense + expert
    low = fp8_params(cfg.model, lay)
    column = low and fp8_transposes(cfg.model, gpu) and cfg.model.fp8 not in TENSOR_SCALED  # MXFP8's column-wise buffer
    fp8_linear = (FP8_BYTES * (2 if column else 1)) if low else None

    def weight_bytes(p) -> float:
        return fp8_linear if (p.linear and fp8_linear) else pbytes

    def shard(ps, group: int) -> float:  # this rank's share of the buffers of `ps`, by dtype
        by_bytes: dict[float, int] = {}
        for p in ps:
            by_bytes[weight_bytes(p)] = by_bytes.get(weight_bytes(p), 0) + p.numel
        return sum(-(-k // group) * b for b, k in by_bytes.items())

    owned = -(-dense // n) + -(-expert // lay.edp)  # elements this rank owns
    weights = shard([p for p in params if not p.expert], n) + shard([p for p in params if p.expert], lay.edp) \
        if zero3 else sum(weight_bytes(p) * p.numel for p in params)
    main = owned * 4 if lay.precision in ("bf16", "fp16") else 0
    # Transformer Engine's copies beyond the buffers: of the gathered unit's GEMM weights (ZeRO-3), of every layer's
    # (ZeRO-2); MXFP8's column-wise data is in the buffers already.
    copies = weight_copy_bytes(cfg.model, cfg.performance, lay, gpu) - (FP8_BYTES if column else 0)
    linear = _units([p for p in params if p.linear])
    fp8 = int(copies * (max(linear, default=0) if zero3 else sum(linear)))
    static = StaticMemory(params=total, expert_params=expert, weights=int(weights),
                          gradients=owned * gbytes, optimizer_moments=owned * 8, optimizer_main_params=main,
                          fp8=fp8, largest_param=max((p.numel for p in params), default=0))
    unit = max(_units(params), default=0)
    unit_bytes = max(_units(params, weight_bytes), default=0)
    return FsdpMemory(static=static, gathered_params=2 * unit_bytes if zero3 else 0,
                      unsharded_grads=2 * unit * gbytes, largest_unit=unit)


def fsdp_comm_bytes(o: OptimizerConfig, lay: Layout, params: int, expert_params: int) -> tuple[float, float]:
    """(dense, expert) bytes one rank sends per step in Megatron-FSDP's all-gathers and reduce-scatters (`o`: the
    optimizer section)."""
    pbytes = lay.bytes_per_value
    gbytes = 4 if o.grad_reduce_in_fp32 else pbytes
    m = lay.num_microbatches

    def volume(p: int, n: int) -> float:
        if n <= 1:
            return 0.0
        f = (n - 1) / n * p
        if lay.fsdp_sharding == "optim_grads_params":
            return m * f * (2 * pbytes + gbytes)
        return f * (m * gbytes + pbytes)

    return volume(params - expert_params, lay.dp * lay.cp), volume(expert_params, lay.edp)
