"""The training loop on Megatron-Core, top to bottom.

    python -m pretrain train CONFIG [overrides]              # one process
    torchrun --nproc-per-node N -m pretrain train CONFIG ... # several

validate → process groups → tokenizer → model chunks (layout-invariant init) → DDP → optimizer and LR
schedule → resume or pretrained weights → datasets → steps (forward/backward schedule, optimizer step,
metrics, checkpoints, signals, time limit, NaN policy) → final checkpoint → exit status.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain import compat
from pretrain.compat import mcore
from pretrain.config import Config
from pretrain.layout import Layout, derive_layout
from pretrain.run_dir import EXIT_STATUS_FILE, StorageError, write_exit_status  # noqa: F401 (EXIT_STATUS_FILE)
from pretrain.validate import ValidationFailed, validate


class TrainingStopped(RuntimeError):
    """The run stopped on purpose with a message for the user (e.g. NaN loss with nan_policy=stop)."""


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


def wrap_with_ddp(cfg: Config, chunks, transformer_config):
    """Megatron DDP around each model chunk (contiguous grad buffers, distributed optimizer layout), or
    Megatron-FSDP with optimizer.fsdp (parameters, gradients and optimizer state sharded over DP)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    fsdp = cfg.optimizer.fsdp
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.optimizer.grad_reduce_in_fp32,
        overlap_grad_reduce=cfg.optimizer.overlap_grad_reduce,
        overlap_param_gather=cfg.optimizer.overlap_param_gather,
        use_distributed_optimizer=cfg.optimizer.distributed or fsdp,
        check_for_nan_in_grad=False,
        average_in_collective=False,
        use_megatron_fsdp=fsdp,
        data_parallel_sharding_strategy="optim_grads_params" if fsdp else "no_shard",
    )
    if not fsdp:
        return [DistributedDataParallel(config=transformer_config, ddp_config=ddp_config, module=chunk,
                                        disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    device = None if torch.cuda.is_available() else torch.device("cpu")  # its default is cuda:current
    return [FullyShardedDataParallel(config=transformer_config, ddp_config=ddp_config, module=chunk,
                                     disable_bucketing=i > 0, device=device) for i, chunk in enumerate(chunks)]


def build_optimizer(cfg: Config, model, layout: Layout):
    """Megatron-Core Adam(W) (distributed optimizer when optimizer.distributed)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = cfg.optimizer
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=layout.precision == "bf16",
        fp16=layout.precision == "fp16",
        params_dtype=layout.params_dtype,
        use_distributed_optimizer=o.distributed or o.fsdp,
        overlap_param_gather_with_optimizer_step=False,
    )
    return get_megatron_optimizer(opt_config, model)


def build_scheduler(cfg: Config, optimizer):
    """Warmup then cosine / linear / WSD / constant decay, stepped once per training step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = cfg.optimizer
    decay_steps = o.decay_steps or cfg.train.steps
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


def connect_schedule_hooks(transformer_config, model, optimizer, cfg: Config) -> None:
    """What Megatron-Core's schedules call back into: grad scaling, grad sync/finalise, param sync."""
    from megatron.core.distributed import finalize_model_grads

    transformer_config.grad_scale_func = optimizer.scale_loss
    transformer_config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in model]
    transformer_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if cfg.optimizer.overlap_grad_reduce:
        sync = [chunk.start_grad_sync for chunk in model]
        transformer_config.grad_sync_func = sync[0] if len(sync) == 1 else sync
    if cfg.optimizer.overlap_param_gather and cfg.optimizer.distributed:
        sync = [chunk.start_param_sync for chunk in model]
        transformer_config.param_sync_func = sync[0] if len(sync) == 1 else sync


def initialize_tp_comm_overlap(cfg: Config) -> None:
    """Transformer Engine userbuffers for TP communication overlap (GPU + TE only; the validator checks).

    Buffers are sized for one microbatch's sequence-parallel activations: [seq·mbs/CP, hidden].
    """
    from transformer_engine.pytorch import module as te_module

    shape = [cfg.model.seq_length * cfg.train.micro_batch_size // cfg.parallel.context, cfg.model.hidden_size]
    te_module.base.initialize_ub(shape=shape, tp_size=cfg.parallel.tensor, use_fp8=cfg.model.fp8 is not None)


def lm_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of per-token losses under the mask, the token count, and both for logging."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm_loss": report}


def forward_step(data_iterator, model):
    """One microbatch through one model chunk (Megatron-Core schedule callback)."""
    batch = mcore.cp_batch(next(data_iterator))
    unwrapped = model.module if hasattr(model, "module") else model
    pre, post = unwrapped.pre_process, unwrapped.post_process
    output = model(
        batch["tokens"] if pre else None,
        batch["position_ids"] if pre else None,
        batch.get("attention_mask"),  # per-document mask (data.reset_attention_mask), needed on every stage
        labels=batch["labels"] if post else None,
    )
    return output, partial(lm_loss, batch["loss_mask"])


def reduce_loss(losses_reduced: list[dict]) -> float:
    """Per-token loss over the whole global batch (summed over microbatches, DP and CP)."""
    from megatron.core import parallel_state

    if not losses_reduced:
        return float("nan")
    total = torch.stack([x["lm_loss"] for x in losses_reduced]).sum(dim=0).double()
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return (total[0] / total[1].clamp(min=1)).item()


def grads_are_finite(model) -> bool:
    """True when every local gradient in the DDP grad buffers is finite."""
    ok = all(bool(torch.isfinite(b.grad_data).all()) for chunk in model for b in chunk.buffers)
    flag = torch.tensor([0.0 if ok else 1.0])
    if torch.cuda.is_available():
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0.0


class StopRequests:
    """SIGTERM/SIGUSR1 (Slurm's warning before preemption or the time limit) and the wall-clock limit.

    Ranks agree every step with one MAX all-reduce, so all of them save and exit together.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, enabled: bool, exit_duration_in_mins: float | None):
        self.received: int | None = None
        self.start = time.monotonic()
        self.limit_s = exit_duration_in_mins * 60.0 if exit_duration_in_mins else None
        if enabled:
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.received = signum

    def agreed_reason(self, device: torch.device) -> tuple[str | None, str | None]:
        """("signal", name) / ("time_limit", None) / (None, None), the same on every rank."""
        local_signal = self.received or 0
        timed_out = 1 if (self.limit_s is not None and time.monotonic() - self.start >= self.limit_s) else 0
        flags = torch.tensor([float(local_signal), float(timed_out)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0].item() > 0:
            return "signal", signal.Signals(int(flags[0].item())).name
        if flags[1].item() > 0:
            return "time_limit", None
        return None, None


def log0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def holds_the_loss() -> bool:
    """The one rank that writes metrics: last pipeline stage, first TP/CP/DP rank."""
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage(ignore_virtual=True)
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
        and ps.get_data_parallel_rank() == 0
    )


def broadcast_from_last_stage(value: float, device: torch.device) -> float:
    """Make the loss known on every rank (PP stages other than the last have none)."""
    from megatron.core import parallel_state as ps

    t = torch.tensor([value if ps.is_pipeline_last_stage(ignore_virtual=True) else 0.0],
                     dtype=torch.float64, device=device)
    last = ps.get_pipeline_model_parallel_last_rank()
    dist.broadcast(t, src=last, group=ps.get_pipeline_model_parallel_group())
    return t.item()


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def train(cfg: Config) -> dict:
    """Run (or resume) training as configured. Returns a summary on every rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import (
        get_num_microbatches,
        init_num_microbatches_calculator,
        unset_num_microbatches_calculator,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from model_providers.core.builder import build_model
    from pretrain.checkpoint import resume as checkpoint_resume
    from pretrain.checkpoint import save as checkpoint_save
    from pretrain.data import DataError, build_datasets, build_tokenizer, checked_microbatches, data_cache_dir
    from pretrain.flops import flops_per_token, gpu_peak_tflops
    from pretrain.metrics import MetricsWriter, format_step_line
    from pretrain.moe_metrics import MoEMetrics
    from pretrain.profiling import StepProfiler
    from pretrain.rank_timing import RankTiming
    from pretrain.run_dir import prepare_run_dir, write_config, write_failure
    from pretrain.runtime import any_rank_error, env_world_size, init_distributed, init_model_parallel
    from pretrain.wandb_logger import wandb_sinks

    # 1. Pre-flight: every layout rule, before any process group exists.
    problems = validate(cfg, world_size=env_world_size())
    if problems.errors:
        raise ValidationFailed(problems)

    # Signal handlers first: Slurm's warning can arrive while the model and data are still being built.
    stops = StopRequests(cfg.train.exit_signal_handler, cfg.train.exit_duration_in_mins)
    # Megatron-Core compatibility: CPU shims (no CUDA) and the fixes the installed release needs.
    compat.apply(on_gpu=torch.cuda.is_available())
    rt = init_distributed()
    tokenizer = build_tokenizer(cfg.data)
    layout = derive_layout(cfg, rt.world_size, vocab_size=tokenizer.vocab_size, on_gpu=rt.on_gpu)
    init_model_parallel(layout, cfg.train.seed)
    dp_size, dp_rank = layout.dp, ps.get_data_parallel_rank()
    t = cfg.train
    unset_num_microbatches_calculator()
    init_num_microbatches_calculator(rt.rank, None, t.global_batch_size, t.micro_batch_size, dp_size)
    num_microbatches = get_num_microbatches()
    run_dir = Path(cfg.run.dir)
    run_dir_error = any_rank_error(prepare_run_dir(cfg) if rt.rank == 0 else None)  # exit_status: running
    if run_dir_error:
        raise StorageError(run_dir_error)
    for line in [f"warning: {w}" for w in problems.warnings] + [f"note: {n}" for n in problems.notes]:
        log0(f"[pretrain] {line}")
    log0(f"[pretrain] world {rt.world_size} ({rt.backend}) = {layout.describe()}; {num_microbatches} microbatches "
         f"of {t.micro_batch_size}; precision {layout.precision}")

    # 2. Model, optimizer, schedule.
    if cfg.parallel.tp_comm_overlap:
        initialize_tp_comm_overlap(cfg)
    chunks = build_model(cfg, layout)
    tconfig = chunks[0].config
    model = wrap_with_ddp(cfg, chunks, tconfig)
    optimizer = build_optimizer(cfg, model, layout)
    scheduler = build_scheduler(cfg, optimizer)
    connect_schedule_hooks(tconfig, model, optimizer, cfg)
    profiler = StepProfiler(cfg.logging.profile, cfg.run.dir, rt.rank, rt.on_gpu)  # logging.profile window
    timing = RankTiming(cfg.logging.timing_interval, rt.rank, rt.world_size, rt.device)  # slowest ranks
    timing.install(tconfig, optimizer)
    moe = MoEMetrics.attach(chunks)  # None for a dense model
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    log0(f"[pretrain] model {cfg.model.preset or cfg.model.family}: {n_params:,} parameters on rank 0")

    # 3. Resume from run.dir's own checkpoint, else start from pretrained weights, else from scratch.
    step, consumed, resumed = checkpoint_resume.start_from_checkpoint(cfg, model, optimizer, scheduler, log0)
    # Only now, with the config validated and any checkpoint loaded into this model, does the run dir record
    # it (a failed resume leaves the config of the run that wrote the checkpoint in place).
    if rt.rank == 0:
        write_config(cfg)

    # 4. Data.
    eval_steps = (t.steps // t.eval_interval) * t.eval_iters if t.eval_interval else 0
    try:
        train_ds, valid_ds = build_datasets(cfg, tokenizer, t.steps * t.global_batch_size,
                                            eval_steps * t.global_batch_size)
    except Exception as exc:  # Megatron wraps a full or read-only cache in two generic exceptions
        why = write_failure(exc, data_cache_dir(cfg))
        if why is None:
            raise
        raise StorageError(f"{data_cache_dir(cfg)}: writing the data cache failed: {why}") from exc
    is_writer = holds_the_loss()
    writer = MetricsWriter(cfg.run.dir, tensorboard=cfg.logging.tensorboard, sinks=wandb_sinks(cfg)) \
        if is_writer else None
    if writer is not None:
        writer.truncate_after(step)

    forward_backward = profiler.wrap("forward_backward", get_forward_backward_func())
    load_microbatches = profiler.wrap("data", timing.wrap("data", checked_microbatches))
    step_optimizer = profiler.wrap("optimizer", optimizer.step)
    seq = cfg.model.seq_length
    tokens_per_step = t.global_batch_size * seq
    flops_tok = flops_per_token(cfg.model, layout.padded_vocab)
    peak = gpu_peak_tflops(torch.cuda.get_device_name(), bool(cfg.model.fp8)) if rt.on_gpu else None
    reason, signal_name, message = "completed", None, None
    last_saved = step if resumed else None
    async_saves = checkpoint_save.AsyncSaves() if cfg.checkpoint.async_save else None

    def save(at_step: int) -> None:
        nonlocal last_saved
        if last_saved == at_step:
            return
        t0 = time.perf_counter()
        path = checkpoint_save.save_checkpoint(cfg, model, optimizer, scheduler, step=at_step,
                                               consumed_samples=consumed, async_saves=async_saves)
        last_saved = at_step
        how = "started async save of" if async_saves is not None else "saved"
        log0(f"[pretrain] {how} {path} in {time.perf_counter() - t0:.2f} s")

    def save_or_stop() -> bool:
        """Periodic checkpoint, async-save commits, and the agreed stop decision (True: stop now)."""
        nonlocal reason, signal_name
        if async_saves is not None:
            async_saves.finalize(blocking=False)
        if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
            save(step)
        why, signal_name = stops.agreed_reason(rt.device)
        if why is not None:
            reason = why
            log0(f"[pretrain] {why}{f' ({signal_name})' if signal_name else ''} at step {step}: "
                 "saving and exiting")
        return why is not None

    def run_microbatches(start_sample: int, forward_only: bool, dataset) -> list:
        try:  # every batch is checked when some dataset's ids could not be checked up front
            batches = load_microbatches(
                dataset, start_sample, num_microbatches=num_microbatches, micro_batch_size=t.micro_batch_size,
                dp_rank=dp_rank, dp_size=dp_size, device=rt.device,
                vocab_size=layout.vocab_size if problems.ids_unchecked else None)
        except DataError as exc:
            raise TrainingStopped(f"{exc}. The last checkpoint is intact.") from None
        iterators = [iter(batches) for _ in model] if len(model) > 1 else iter(batches)
        return forward_backward(forward_step_func=forward_step, data_iterator=iterators, model=model,
                                num_microbatches=num_microbatches, seq_length=seq,
                                micro_batch_size=t.micro_batch_size, forward_only=forward_only)

    # 5. Steps.
    try:
        while step < t.steps:
            started = time.perf_counter()
            profiler.step_begin(step + 1)
            timing.begin(step + 1)
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            losses = run_microbatches(consumed, False, train_ds)
            loss = broadcast_from_last_stage(reduce_loss(losses) if losses else float("nan"), rt.device)
            moe_record = moe.step(num_microbatches) if moe is not None else {}
            if not math.isfinite(loss) or (t.nan_policy == "skip" and not grads_are_finite(model)):
                what = f"loss {loss}" if not math.isfinite(loss) else "non-finite gradients"
                if t.nan_policy == "stop":
                    raise TrainingStopped(
                        f"step {step + 1}: {what}; stopping (train.nan_policy=stop). The last checkpoint "
                        f"is intact; lower optimizer.lr or set train.nan_policy=skip to skip such steps.")
                log0(f"[pretrain] step {step + 1}: {what}; batch skipped (train.nan_policy=skip)")
                consumed += t.global_batch_size
                step += 1
                if save_or_stop():
                    break
                continue
            ok, grad_norm, _ = step_optimizer()
            if ok:
                scheduler.step(increment=1)
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            if not math.isfinite(grad_norm) and t.nan_policy == "stop":
                raise TrainingStopped(f"step {step + 1}: gradient norm {grad_norm}; stopping "
                                      "(train.nan_policy=stop). The last checkpoint is intact.")
            step += 1
            consumed += t.global_batch_size
            step_time = time.perf_counter() - started
            timing_fields = timing.end(step)  # on every timing_interval-th step: all ranks' compute/wait split
            profiler.step_end(step)
            if writer is not None:
                record = {
                    "step": step,
                    "loss": loss,
                    "lr": optimizer.param_groups[0]["lr"],
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_step / step_time,
                    "step_time_s": step_time,
                    "consumed_samples": consumed,
                }
                record["tokens_per_s_per_gpu"] = record["tokens_per_s"] / rt.world_size
                record["tflops_per_gpu"] = flops_tok * record["tokens_per_s_per_gpu"] / 1e12
                if peak:
                    record["mfu"] = record["tflops_per_gpu"] / peak
                if rt.on_gpu:
                    record["mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                record.update(timing_fields)
                record.update(moe_record)
                writer.write(record)
                if step % cfg.logging.log_interval == 0 or step == t.steps:
                    print("[pretrain] " + format_step_line(record, t.steps), flush=True)
            if t.eval_interval and step % t.eval_interval == 0 and valid_ds is not None:
                evaluate(cfg, run_microbatches, valid_ds, step, writer, rt.device)
            if save_or_stop():
                break
        if cfg.checkpoint.save_at_end or reason != "completed":
            save(step)
        if async_saves is not None:
            async_saves.finalize(blocking=True)
    except TrainingStopped as exc:
        reason, message = "failed", str(exc)
        if async_saves is not None:  # all ranks stop together here: commit the save in flight
            async_saves.finalize(blocking=True)
        if rt.rank == 0:
            write_exit_status(cfg, reason, step, None, message)
        raise
    except BaseException:
        if async_saves is not None:  # a save in flight stays uncommitted; the previous one is used
            async_saves.abort()
        raise
    finally:
        profiler.close(step)
        if writer is not None:
            writer.close()
    if rt.rank == 0:
        write_exit_status(cfg, reason, step, signal_name, message)
    log0(f"[pretrain] {reason} at step {step}; run dir {run_dir.resolve()}")
    return {"reason": reason, "step": step, "consumed_samples": consumed}


def evaluate(cfg: Config, run_microbatches, valid_ds, step: int, writer, device) -> float:
    """Mean per-token validation loss over train.eval_iters global batches."""
    from megatron.core import parallel_state as ps

    t = cfg.train
    eval_index = step // t.eval_interval - 1
    total = 0.0
    with torch.no_grad():
        for i in range(t.eval_iters):
            start = (eval_index * t.eval_iters + i) * t.global_batch_size
            losses = run_microbatches(start, True, valid_ds)
            total += broadcast_from_last_stage(reduce_loss(losses) if losses else 0.0, device)
    value = total / t.eval_iters
    if writer is not None:
        writer.write({"step": step, "valid_loss": value})
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        log0(f"[pretrain] step {step}: validation loss {value:.6f}")
    return value


def main(cfg: Config) -> int:
    """CLI entry: train, turning expected failures into one clear message and a non-zero exit.

    Exit status: 2 invalid config, 3 stopped on purpose (NaN), 1 unusable checkpoint or run directory, or a
    full / read-only / forbidden file system (the message names the path).
    """
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.run_dir import environment_error, os_error_line, report_failure
    from pretrain.runtime import shutdown

    try:
        train(cfg)
        return 0
    except ValidationFailed as exc:
        print(exc.report(), file=sys.stderr, flush=True)
        return 2
    except TrainingStopped as exc:
        print(f"[pretrain] error: {exc}", file=sys.stderr, flush=True)
        return 3
    except (CheckpointError, StorageError) as exc:
        return report_failure(cfg, str(exc))
    except Exception as exc:
        os_error = environment_error(exc)
        if os_error is None:
            raise  # not an expected failure: the traceback is the report
        return report_failure(cfg, os_error_line(os_error))
    finally:
        shutdown()

