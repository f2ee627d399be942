"""Setting a training run up, before its first step: runtime, process groups, model, optimizer, schedule, data.

`pretrain.train.train` calls these in order (pre-flight validation and `compat.apply()` come first, there):
`start_run` (tokenizer, derived layout, process groups, microbatches, run dir), `build_training` (model chunks,
DDP / Megatron-FSDP, optimizer, LR schedule, schedule hooks, step instruments) and, after the resume,
`build_data` (datasets and the metrics writer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from model_providers.core.knobs import DDP, mcore_kwargs
from model_providers.core.optimizer_config import optimizer_config
from pretrain.config import OptimizerConfig, RerunConfig
from pretrain.layout import Layout
from pretrain.problems import Report
from pretrain.run.run_dir import StorageError
from pretrain.tokenizer.choice import load as load_tokenizer


@dataclass
class Run:
    """What set-up builds for the loop (filled in by `start_run`, `build_training` and `build_data`)."""

    rt: Any  # pretrain.run.runtime.Runtime
    plan: Any  # pretrain.run_plan.RunPlan
    problems: Report
    tokenizer: Any
    layout: Layout
    num_microbatches: int
    dp_rank: int
    chunks: list | None = None
    model: list | None = None
    optimizer: Any = None
    scheduler: Any = None
    profiler: Any = None  # pretrain.observe.profiling.StepProfiler
    timing: Any = None  # pretrain.observe.rank_timing.RankTiming
    moe: Any = None  # pretrain.observe.moe_metrics.MoEMetrics, None for a dense model
    train_ds: Any = None
    valid_ds: Any = None
    writer: Any = None  # pretrain.observe.metrics.MetricsWriter on the rank that holds the loss, else None
    tp_source: tuple | None = None  # TP > 1: (TP group, its reading rank); the other ranks have no datasets
    evaluates: bool = False  # there is a validation split (valid_ds is None on the ranks that do not read data)
    global_batch_size: int = 0  # this step's (`advance_batch`: Megatron's calculator, ramp-up included)
    stage: Any = None  # pretrain.stages.spec.Stage of a run in stages, else None
    update: Any = None  # the step's update (`optimizer_update`): () -> (ok, grad norm, zeros)


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


def ddp_config(o: OptimizerConfig, rerun: RerunConfig, gloo: bool):
    """Megatron-Core's `DistributedDataParallelConfig` for the run (`gloo`: the process groups' backend)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from pretrain.layout import fsdp_sharding

    sharding = fsdp_sharding(o)  # None: Megatron DDP
    return DistributedDataParallelConfig(
        **mcore_kwargs(o, DDP),  # the optimizer section's fields declared mcore=DDP
        use_distributed_optimizer=o.distributed or sharding is not None,
        # Each bucket's gradient norm validated by the rerun state machine (pretrain/resilience/results.py).
        check_for_nan_in_grad=rerun.mode == "validate_results" and sharding is None,
        average_in_collective=False,
        use_megatron_fsdp=sharding is not None,
        data_parallel_sharding_strategy=sharding or "no_shard",
        # The fused reduce-and-divide is NCCL's premultiplied sum (_make_nccl_premul_sum): not on gloo.
        gradient_reduce_div_fusion=not gloo,
    )


def wrap_with_ddp(o: OptimizerConfig, rerun: RerunConfig, chunks, transformer_config):
    """Megatron DDP around each model chunk (contiguous grad buffers, distributed optimizer layout), or
    Megatron-FSDP with optimizer.fsdp (parameters, gradients and optimizer state sharded over DP)."""
    from megatron.core.distributed import DistributedDataParallel

    config = ddp_config(o, rerun, gloo=torch.distributed.get_backend() == "gloo")
    if not config.use_megatron_fsdp:
        return [DistributedDataParallel(config=transformer_config, ddp_config=config, module=chunk,
                                        disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    device = None if torch.cuda.is_available() else torch.device("cpu")  # its default is cuda:current
    return [FullyShardedDataParallel(config=transformer_config, ddp_config=config, module=chunk,
                                     disable_bucketing=i > 0, device=device) for i, chunk in enumerate(chunks)]


def build_optimizer(o: OptimizerConfig, model, layout: Layout, log=None):
    """Megatron-Core Adam(W) (distributed optimizer when optimizer.distributed), or Muon (`pretrain.optim.muon`)."""
    from megatron.core.optimizer import get_megatron_optimizer

    if o.name == "muon":
        from pretrain.optim.muon import build_muon_optimizer

        return build_muon_optimizer(o, model, layout, optimizer_config(o, layout), log)
    return get_megatron_optimizer(optimizer_config(o, layout), model)


def build_scheduler(o: OptimizerConfig, train_steps: int, optimizer):
    """Warmup then cosine / linear / WSD / constant decay, stepped once per training step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = o.decay_steps or train_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if o.warmup_steps else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=max(decay_steps, o.warmup_steps + 1),
        lr_decay_style=o.decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
        wsd_decay_steps=o.wsd_decay_steps,
        lr_wsd_decay_style=o.lr_wsd_decay_style,
    )


def connect_schedule_hooks(transformer_config, model, optimizer, o: OptimizerConfig) -> None:
    """What Megatron-Core's schedules call back into: grad scaling, grad sync/finalise, param sync."""
    from megatron.core.distributed import finalize_model_grads

    transformer_config.grad_scale_func = optimizer.scale_loss
    transformer_config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in model]
    transformer_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if o.overlap_grad_reduce:
        sync = [chunk.start_grad_sync for chunk in model]
        transformer_config.grad_sync_func = sync[0] if len(sync) == 1 else sync
    if o.overlap_param_gather and o.distributed:
        sync = [chunk.start_param_sync for chunk in model]
        transformer_config.param_sync_func = sync[0] if len(sync) == 1 else sync


def initialize_tp_comm_overlap(m, layout: Layout) -> None:
    """Transformer Engine userbuffers for TP communication overlap (GPU + TE only; the validator checks).

    Buffers are sized for one microbatch's sequence-parallel activations: [seq·mbs/CP, hidden] (`m`: the model
    section).
    """
    from transformer_engine.pytorch import module as te_module

    shape = [m.seq_length * layout.mbs // layout.cp, m.hidden_size]
    te_module.base.initialize_ub(shape=shape, tp_size=layout.tp, use_fp8=m.fp8 is not None)


# --------------------------------------------------------------------------------------------------
# The set-up steps
# --------------------------------------------------------------------------------------------------


def start_run(plan, rt, log) -> Run:
    """Tokenizer (as `plan` decided it), model-parallel groups of `plan.layout`, microbatch calculator, and the run
    dir marked running."""
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from pretrain.compat.mcore import init_microbatch_calculator
    from pretrain.run.run_dir import prepare_run_dir
    from pretrain.run.runtime import any_rank_error, init_model_parallel

    cfg, layout, problems = plan.cfg, plan.layout, plan.problems
    tokenizer = load_tokenizer(plan.tokenizer, cfg.data, cfg.model.vocab_size)
    if layout.vocab_size != tokenizer.vocab_size and not cfg.model.vocab_size:  # the plan read the same files
        raise RuntimeError(f"tokenizer changed while the run started: {layout.vocab_size} → {tokenizer.vocab_size}")
    init_model_parallel(layout, cfg.train.seed)
    t = cfg.train
    init_microbatch_calculator(rt.rank, t.rampup_batch_size, t.global_batch_size, t.micro_batch_size, layout.dp)
    run = Run(rt=rt, plan=plan, problems=problems, tokenizer=tokenizer, layout=layout,
              num_microbatches=get_num_microbatches(), dp_rank=ps.get_data_parallel_rank())
    run_dir_error = any_rank_error(prepare_run_dir(cfg.run.dir) if rt.rank == 0 else None)  # exit_status: running
    if run_dir_error:
        raise StorageError(run_dir_error)
    for line in [f"warning: {w}" for w in problems.warnings] + [f"note: {n}" for n in problems.notes]:
        log(f"[pretrain] {line}")
    ramp = f" (ramp-up {t.rampup_batch_size}: from {run.num_microbatches})" if t.rampup_batch_size else ""
    log(f"[pretrain] world {rt.world_size} ({rt.backend}) = {layout.describe()}; {layout.num_microbatches} "
        f"microbatches of {t.micro_batch_size}{ramp}; precision {layout.precision}")
    return run


def advance_batch(run: Run, consumed: int) -> int:
    """The global batch of the step that starts after `consumed` samples, by Megatron-Core's calculator (its
    batch-size ramp-up, consistency-checked against micro batch × DP): sets `run.num_microbatches` and
    `run.global_batch_size`, returns the batch."""
    from megatron.core import num_microbatches_calculator as calc

    calc.update_num_microbatches(consumed, consistency_check=True)
    run.num_microbatches = calc.get_num_microbatches()
    run.global_batch_size = calc.get_current_global_batch_size()
    return run.global_batch_size


def build_training(run: Run, log) -> None:
    """Model chunks, DDP (or Megatron-FSDP), optimizer, LR schedule, schedule hooks, the step's update and the step
    instruments, as the run's plan says (its config: the parallel, optimizer, rerun, train, logging, run and model
    sections)."""
    from model_providers.core.builder import build_model
    from pretrain.observe.moe_metrics import MoEMetrics
    from pretrain.observe.profiling import StepProfiler
    from pretrain.observe.rank_timing import RankTiming

    rt, cfg = run.rt, run.plan.cfg
    if cfg.parallel.tp_comm_overlap:
        initialize_tp_comm_overlap(cfg.model, run.layout)
    run.chunks = build_model(run.plan.model, run.layout)
    tconfig = run.chunks[0].config
    o = cfg.optimizer
    run.model = wrap_with_ddp(o, cfg.rerun, run.chunks, tconfig)
    run.optimizer = build_optimizer(o, run.model, run.layout, log)
    run.scheduler = build_scheduler(o, cfg.train.steps, run.optimizer)
    connect_schedule_hooks(tconfig, run.model, run.optimizer, o)
    run.profiler = StepProfiler(cfg.logging.profile, cfg.run.dir, rt.rank, rt.on_gpu)  # logging.profile window
    run.timing = RankTiming(cfg.logging.timing_interval, rt.rank, rt.world_size, rt.device)  # slowest ranks
    run.timing.install(tconfig, run.optimizer)
    run.moe = MoEMetrics.attach(run.chunks)  # None for a dense model
    run.update = optimizer_update(run)  # optimizer step, LR schedule step, QK-clip
    n_params = sum(p.numel() for c in run.chunks for p in c.parameters())
    log(f"[pretrain] model {cfg.model.preset or cfg.model.family}: {n_params:,} parameters on rank 0")


def optimizer_update(run: Run):
    """The step's update as the loop calls it: Megatron-Core's optimizer step (profiled as "optimizer"); where it
    succeeded, the LR schedule's step and Muon's QK-clip (optimizer.muon.qk_clip; nothing otherwise). Returns the
    optimizer's (ok, grad norm, zeros)."""
    from pretrain.optim import muon

    step = run.profiler.wrap("optimizer", run.optimizer.step)
    o, model, scheduler = run.plan.cfg.optimizer, run.model, run.scheduler

    def update():
        ok, grad_norm, zeros = step()
        if ok:
            scheduler.step(increment=1)
            muon.after_step(o, model)
        return ok, grad_norm, zeros

    return update


def build_data(run: Run, step: int, writes_metrics: bool, consumed: int | None = None, first_step: int = 0,
               log=None) -> None:
    """Train/validation datasets sized for the run and, on the rank that writes metrics, the metrics writer
    (its lines after `step`, written after the checkpoint a resumed run restarts from, dropped). A resumed run
    reads from `consumed` samples on, `train.global_batch_size` per remaining step (the batch size may have
    changed on resume); at least the samples of steps `first_step` + 1 … train.steps are built (a stage's data,
    read from its own first sample: the same dataset at every resume in the stage, and for the first stage a plain
    run's). `log` (rank 0): how long Megatron's index caches took and where they are. The run's plan: its data plan,
    and the train, run and logging sections."""
    from pretrain.data.datasets import build_datasets
    from pretrain.observe.metrics import MetricsWriter
    from pretrain.observe.wandb_logger import wandb_sinks
    from pretrain.run.run_dir import write_failure

    cfg = run.plan.cfg
    t = cfg.train
    eval_steps = (t.steps // t.eval_interval) * t.eval_iters if t.eval_interval else 0
    from megatron.core import parallel_state as ps

    # One reader per tensor-parallel group (its first rank) holds the datasets and sends the others its batches.
    reads = ps.get_tensor_model_parallel_rank() == 0
    if run.layout.tp > 1:
        run.tp_source = (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank())
    try:
        needed = (consumed or 0) + max(t.steps - step, 0) * t.global_batch_size
        run.train_ds, run.valid_ds = build_datasets(run.plan.data, run.tokenizer,
                                                    max(needed, (t.steps - first_step) * t.global_batch_size),
                                                    eval_steps * t.global_batch_size,
                                                    is_built_on_rank=lambda: reads, log=log)
    except Exception as exc:  # Megatron wraps a full or read-only cache in two generic exceptions
        why = write_failure(exc, run.plan.data.cache_dir)
        if why is None:
            raise
        raise StorageError(f"{run.plan.data.cache_dir}: writing the data cache failed: {why}") from exc
    # Whether there is a validation split to evaluate on, known on the reading ranks: shared with every rank.
    has_valid = torch.tensor([1.0 if run.valid_ds is not None else 0.0], device=run.rt.device)
    torch.distributed.all_reduce(has_valid, op=torch.distributed.ReduceOp.MAX)
    run.evaluates = bool(has_valid.item())
    run.writer = MetricsWriter(cfg.run.dir, tensorboard=cfg.logging.tensorboard, sinks=wandb_sinks(cfg)) \
        if writes_metrics else None
    if run.writer is not None:
        run.writer.truncate_after(step)
