"""What every part of the planner shares: the GPU table, the layout a plan is made for (the run's own derived
`pretrain.layout.Layout`), the padded vocabulary, and the validator's verdict on a layout."""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

from pretrain.config import Config
from pretrain.layout import Layout, LayoutError, derive_layout, padded_vocab_size
from pretrain.planner.hardware import GPUS

GIB = 2**30

# Usable device memory (GiB) and per-GPU link bandwidths (GB/s, one direction): views of `planner.hardware.GPUS`.
GPU_MEMORY_GIB = {name: round(g.memory_gib, 1) for name, g in GPUS.items()}
NVLINK_GBPS = {name: g.nvlink_gbps for name, g in GPUS.items()}
NETWORK_GBPS = {name: g.network_gbps for name, g in GPUS.items()}
# A layout fits when its planned peak leaves what the plan does not count free: the CUDA context, NCCL's and
# cuBLAS's workspaces (RESERVE_GIB) and the allocator's fragmentation (FRAGMENTATION of the GPU's memory).
# FRAGMENTATION is calibrated on rows 3, 52, 96, 132 and 171 of Megatron-Bridge's published pre-training table
# (benchmarks/megatron_bridge_pretraining.tsv: Llama-3-70B on 64 GB200, FP8, Megatron-FSDP, 40 layers offloaded,
# micro batch 2), the published runs that leave the least free in our plan: 175.3 of 184.4 GiB, 9.1 GiB for the
# reserve and fragmentation, which 4 GiB + 2.77% fills. They ran, so the share is at most that; 2.5% is the largest
# multiple of 0.5% under it (it was 5%, with no measurement behind it). Rows whose published layout cannot fit under
# any reserve (91, 93, 195, 189: 20 GiB and more over the GPU itself) do not bound it (docs/performance.md).
RESERVE_GIB = 4.0
FRAGMENTATION = 0.025
HEADROOM = 0.925  # the share of an 80 GB H100 that fits (73.6 GiB; docs and tests quote it); `fit_limit_gib` rules


def fit_limit_gib(capacity_gib: float) -> float:
    """The planned peak (GiB) a GPU of `capacity_gib` holds: all of it but the reserve and the fragmentation."""
    return capacity_gib * (1 - FRAGMENTATION) - RESERVE_GIB
DEFAULT_MFU = 0.40
GEMM_EFFICIENCY = 0.60  # cost model: fraction of peak the model's GEMMs reach without bubbles/communication


class PlanError(ValueError):
    """A plan request that cannot be answered (bad layout, unknown GPU, ...)."""


def layout_of(cfg: Config, world: int, *, on_gpu: bool = True, use_te: bool | None = None) -> Layout:
    """The run's derived layout (`pretrain.layout`) of `cfg` on `world` ranks, for planning: on a GPU the
    Transformer Engine spec unless model.transformer_impl is local (`use_te` forces the choice)."""
    try:
        lay = derive_layout(cfg, world, on_gpu=on_gpu, te=on_gpu)
    except LayoutError as exc:
        raise PlanError(str(exc)) from None
    return lay if use_te is None else replace(lay, use_te=use_te)


def padded_vocab_for(cfg: Config) -> int:
    """The padded vocabulary (model.vocab_size, else the size of the tokenizer the run plan decides)."""
    vocab = cfg.model.vocab_size
    if not vocab:
        from pretrain.run_plan import resolve_tokenizer

        tokenizer = resolve_tokenizer(cfg)
        vocab = tokenizer.vocab_size
        if vocab is None:
            raise PlanError(f"cannot size the vocabulary ({tokenizer.error}); set model.vocab_size")
    return padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor)


@functools.lru_cache(maxsize=1)
def _installed():
    """This interpreter's versions, read once (the search validates thousands of layouts)."""
    from pretrain.compat import matrix

    return matrix.installed()


def check_layout(cfg: Config, world: int, use_te: bool) -> list[str]:
    """The validator's errors for `cfg` on a GPU cluster of `world` ranks (data need not be configured)."""
    return checked_layout(cfg, world, use_te)[0]


def checked_layout(cfg: Config, world: int, use_te: bool,
                   vocab_size: int | None = None) -> tuple[list[str], Layout | None]:
    """`check_layout`'s errors and the layout the validator derived on the way (`vocab_size`: the tokenizer's, when
    model.vocab_size is unset), so a candidate's layout is derived once."""
    from pretrain.validate import check

    planning = copy.deepcopy(cfg)
    planning.data.mock = True
    report, lay = check(planning, world, te_on_gpu=use_te, cuda_available=True, files=False, versions=_installed(),
                        vocab_size=vocab_size)
    return [str(e) for e in report.errors], lay


def cluster_plan(cfg: Config, world: int, use_te: bool):
    """The run plan (`pretrain.run_plan.RunPlan`) of `cfg` on a GPU cluster of `world` ranks: the tokenizer resolved
    and the layout derived once, by validation; `PlanError` naming the validator's errors or an unknown vocabulary."""
    from pretrain.run_plan import for_cluster

    run = for_cluster(cfg, world, use_te=use_te, versions=_installed())
    if run.problems.errors:
        raise PlanError(f"layout does not pass validation on {world} GPUs: "
                        + " | ".join(str(e) for e in run.problems.errors))
    if run.layout is None or run.layout.padded_vocab is None:
        why = run.tokenizer.error if run.tokenizer is not None else None
        raise PlanError(f"cannot size the vocabulary ({why}); set model.vocab_size")
    return run
