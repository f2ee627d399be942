"""What every part of the planner shares: the GPU table, the layout a plan is made for, the padded
vocabulary, and the validator's verdict on a layout."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from pretrain.config import Config

GIB = 2**30

# Usable device memory as torch reports it (GiB), and per-GPU link bandwidths (GB/s, one direction).
GPU_MEMORY_GIB = {"h100": 79.6, "h200": 140.4, "b200": 178.4, "a100": 79.2}
NVLINK_GBPS = {"h100": 450.0, "h200": 450.0, "b200": 900.0, "a100": 300.0}
NETWORK_GBPS = {"h100": 50.0, "h200": 50.0, "b200": 100.0, "a100": 25.0}  # one 400/800 Gb/s NIC per GPU
HEADROOM = 0.90  # a layout fits when its planned peak is below this fraction of GPU memory
DEFAULT_MFU = 0.40
GEMM_EFFICIENCY = 0.60  # cost model: fraction of peak the model's GEMMs reach without bubbles/communication


class PlanError(ValueError):
    """A plan request that cannot be answered (bad layout, unknown GPU, ...)."""


@dataclass
class Layout:
    """The parallel layout and numerics a plan is made for."""

    world: int
    tp: int
    pp: int
    vp: int  # 1 without interleaving
    cp: int
    dp: int
    sp: bool
    mbs: int
    gbs: int
    precision: str  # "bf16" | "fp16" | "fp32"
    distributed: bool
    use_te: bool
    on_gpu: bool = True  # CPU runs use the unfused paths (torch's composite RMSNorm, no fused softmax)

    @property
    def num_microbatches(self) -> int:
        return self.gbs // (self.mbs * self.dp)

    @property
    def bytes_per_value(self) -> int:
        return 4 if self.precision == "fp32" else 2


def layout_of(cfg: Config, world: int, *, on_gpu: bool = True, use_te: bool | None = None) -> Layout:
    """The layout of `cfg` on `world` ranks (precision 'auto' is bf16 on GPU, fp32 on CPU)."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor * p.pipeline * p.context
    if world % model_parallel:
        raise PlanError(f"world size {world} is not divisible by tensor×pipeline×context = {model_parallel}")
    precision = t.precision if t.precision != "auto" else ("bf16" if on_gpu else "fp32")
    if use_te is None:
        use_te = on_gpu and cfg.model.transformer_impl != "local"
    return Layout(world=world, tp=p.tensor, pp=p.pipeline, vp=p.virtual_pipeline or 1, cp=p.context,
                  dp=world // model_parallel, sp=p.sequence_parallel, mbs=t.micro_batch_size,
                  gbs=t.global_batch_size, precision=precision, distributed=cfg.optimizer.distributed,
                  use_te=use_te, on_gpu=on_gpu)


def padded_vocab_for(cfg: Config) -> int:
    """The padded vocabulary (model.vocab_size, else the tokenizer's size)."""
    vocab = cfg.model.vocab_size
    if vocab is None:
        try:
            from pretrain.data import build_tokenizer

            vocab = build_tokenizer(cfg.data).vocab_size
        except Exception as exc:
            raise PlanError(f"cannot size the vocabulary ({exc}); set model.vocab_size") from None
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor  # Megatron's padding rule
    return -(-vocab // multiple) * multiple


def check_layout(cfg: Config, world: int, use_te: bool) -> list[str]:
    """The validator's errors for `cfg` on a GPU cluster of `world` ranks (data need not be configured)."""
    from pretrain.validate import validate

    planning = copy.deepcopy(cfg)
    planning.data.mock = True
    report = validate(planning, world, te_on_gpu=use_te, cuda_available=True)
    return [str(e) for e in report.errors]
