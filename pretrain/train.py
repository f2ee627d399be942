"""The training loop on Megatron-Core, top to bottom.

    python -m pretrain train CONFIG [overrides]              # one process
    torchrun --nproc-per-node N -m pretrain train CONFIG ... # several

validate → process groups → tokenizer → model chunks (layout-invariant init) → DDP → optimizer and LR
schedule → resume or pretrained weights → datasets → steps (forward/backward schedule, optimizer step,
metrics, checkpoints, signals, time limit, NaN policy) → final checkpoint → exit status.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain import compat
from pretrain.checkpoint import resume as checkpoint_resume
from pretrain.checkpoint import save as checkpoint_save
from pretrain.checkpoint.context import CheckpointContext
from pretrain.compat import mcore
from pretrain.config import Config
from pretrain.observe.observers import Observers, StepResult, build_observers
from pretrain.optim import muon
from pretrain.resilience import hooks as resilience
from pretrain.resilience.results import first_step_cause
from pretrain.run import output_lock, setup
from pretrain.run.run_dir import EXIT_STATUS_FILE, StorageError, write_exit_status  # noqa: F401 (EXIT_STATUS_FILE)
from pretrain.run_plan import resolve
from pretrain.validate import ValidationFailed


class TrainingStopped(RuntimeError):
    """The run stopped on purpose with a message for the user (e.g. NaN loss with nan_policy=stop)."""


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


def lm_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of per-token losses under the mask, the token count, and both for logging."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
    return loss_sum, num_tokens, {"lm_loss": report}


def forward_step(data_iterator, model):
    """One microbatch through one model chunk (Megatron-Core schedule callback).

    Packed documents (THD, `pretrain.data.datasets.pack_documents`) arrive already cut to this CP rank; other
    batches are cut here (a copy: interleaved model chunks read the same microbatch)."""
    batch = next(data_iterator)
    packed = batch.get("packed_seq_params")
    if packed is None:
        batch = mcore.cp_batch(dict(batch))
    unwrapped = model
    while hasattr(unwrapped, "module"):  # DDP → GPTModel; Megatron-FSDP: adapter → MegatronFSDP → GPTModel
        unwrapped = unwrapped.module
    pre, post = unwrapped.pre_process, unwrapped.post_process
    tokens = pre or getattr(unwrapped, "mtp_process", False)  # MTP embeds the next tokens on its (last) stage
    output = model(
        batch["tokens"] if tokens else None,
        batch["position_ids"] if tokens else None,
        None,  # causal attention; document boundaries travel as packed_seq_params (needed on every stage)
        labels=batch["labels"] if post else None,
        packed_seq_params=packed,
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


def checkpoint_context(run) -> CheckpointContext:
    """What save, load and resume act on: the run's model chunks, optimizer, schedule and plan."""
    return CheckpointContext(model=run.model, optimizer=run.optimizer, scheduler=run.scheduler, plan=run.plan)


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


class _Saves:
    """Checkpoints during the loop: periodic and final saves (a step is saved once), asynchronous commits, and
    the stop decision all ranks agree on (signal or time limit), with the reason the run ends."""

    def __init__(self, cfg: Config, run, stops: StopRequests, last_saved: int | None, observers: Observers):
        self.cfg, self.run, self.stops, self.last_saved, self.observers = cfg, run, stops, last_saved, observers
        self.async_saves = checkpoint_save.AsyncSaves() if cfg.checkpoint.async_save else None
        self.reason, self.signal_name = "completed", None

    def save(self, step: int, consumed: int) -> None:
        if self.last_saved == step:
            return
        t0 = time.perf_counter()
        run = self.run
        path = checkpoint_save.save_checkpoint(checkpoint_context(run), step=step,
                                               consumed_samples=consumed, async_saves=self.async_saves)
        self.last_saved = step
        how = "started async save of" if self.async_saves is not None else "saved"
        log0(f"[pretrain] {how} {path} in {time.perf_counter() - t0:.2f} s")
        self.observers.checkpoint(step, path)

    def save_or_stop(self, step: int, consumed: int) -> bool:
        """Periodic checkpoint, async-save commits, and the agreed stop decision (True: stop now)."""
        if self.async_saves is not None:
            self.async_saves.finalize(blocking=False)
        if self.cfg.checkpoint.interval and step % self.cfg.checkpoint.interval == 0:
            self.save(step, consumed)
        why, self.signal_name = self.stops.agreed_reason(self.run.rt.device)
        if why is not None:
            self.reason = why
            log0(f"[pretrain] {why}{f' ({self.signal_name})' if self.signal_name else ''} at step {step}: "
                 "saving and exiting")
        return why is not None

    def finalize(self) -> None:
        """Commit the save in flight (all ranks together)."""
        if self.async_saves is not None:
            self.async_saves.finalize(blocking=True)

    def abort(self) -> None:
        """After an error: a save in flight stays uncommitted; the previous one is used."""
        if self.async_saves is not None:
            self.async_saves.abort()


def _microbatch_runner(cfg: Config, run):
    """`run_microbatches(start_sample, forward_only, dataset) -> losses`: one global batch through Megatron's
    forward/backward schedule (every batch checked when some dataset's ids could not be checked up front)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from pretrain.data.datasets import DataError, checked_microbatches

    forward_backward = run.profiler.wrap("forward_backward", get_forward_backward_func())
    load_microbatches = run.profiler.wrap("data", run.timing.wrap("data", checked_microbatches))
    t, n, model = cfg.train, run.num_microbatches, run.model
    packing = document_packing(cfg, run)
    # Packed documents are one sequence of micro_batch_size × seq_length tokens (padded under CP: then
    # pipeline stages exchange shapes, `variable_seq_lengths`).
    seq, mbs = (cfg.model.seq_length * t.micro_batch_size, 1) if packing else (cfg.model.seq_length,
                                                                               t.micro_batch_size)

    def run_microbatches(start_sample: int, forward_only: bool, dataset) -> list:
        try:
            batches = load_microbatches(
                dataset, start_sample, num_microbatches=n, micro_batch_size=t.micro_batch_size,
                dp_rank=run.dp_rank, dp_size=run.layout.dp, device=run.rt.device, tp_source=run.tp_source,
                vocab_size=run.layout.vocab_size if run.problems.ids_unchecked else None, packing=packing)
        except DataError as exc:
            raise TrainingStopped(f"{exc}. The last checkpoint is intact.") from None
        iterators = [iter(batches) for _ in model] if len(model) > 1 else iter(batches)
        return forward_backward(forward_step_func=forward_step, data_iterator=iterators, model=model,
                                num_microbatches=n, seq_length=seq, micro_batch_size=mbs,
                                forward_only=forward_only)

    return run_microbatches


def document_packing(cfg: Config, run):
    """`pretrain.data.datasets.DocumentPacking` of this rank with data.reset_attention_mask, else None."""
    from megatron.core import parallel_state as ps

    from pretrain.data.datasets import DocumentPacking

    if not cfg.data.reset_attention_mask:
        return None
    lay = run.layout
    return DocumentPacking(eod=run.tokenizer.eod, cp=lay.cp, cp_rank=ps.get_context_parallel_rank(),
                           sp_tp=lay.tp if lay.sp else 1)


def train(cfg: Config) -> dict:
    """Run (or resume) training as configured. Returns a summary on every rank."""
    from pretrain.data.datasets import check_data_files_once
    from pretrain.run.run_dir import write_config
    from pretrain.run.runtime import any_rank_error, env_world_size, init_distributed
    from pretrain.validate import store_verdicts

    # 1. Pre-flight: every layout rule on every rank, before any model-parallel group exists; the dataset files
    # on rank 0 only, its verdict shared (all problems are reported together, by every rank).
    plan = resolve(cfg, env_world_size(), data_files=False)  # the config resolved once: layout, tokenizer, data
    problems = plan.problems
    # Signal handlers first: Slurm's warning can arrive while the model and data are still being built.
    stops = StopRequests(cfg.train.exit_signal_handler, cfg.train.exit_duration_in_mins)
    # Megatron-Core compatibility: CPU shims (no CUDA) and the fixes the installed release needs.
    compat.apply(on_gpu=torch.cuda.is_available())
    rt = init_distributed(resilience.pg_timeout_minutes(cfg))
    check_data_files_once(plan, rt.device)
    if problems.errors:
        raise ValidationFailed(problems)
    # One writer per run directory: rank 0 locks run.dir before any file is written, every rank learns the verdict.
    outputs = output_lock.hold_run_outputs(cfg, rt.rank, any_rank_error, log0)
    run = setup.start_run(plan, rt, log0)  # tokenizer, process groups of plan.layout, run dir
    if rt.rank == 0:  # validation passed: the data check's full reads are not repeated by later starts
        store_verdicts(plan)

    # 2. Model, optimizer, schedule.
    setup.build_training(cfg, run, log0)
    model, optimizer, scheduler, profiler = run.model, run.optimizer, run.scheduler, run.profiler

    # 3. Resume from run.dir's own checkpoint, else start from pretrained weights, else from scratch. A checkpoint
    # directory that cannot be written is found now, not at the first save.
    checkpoint_save.check_writable(cfg)
    step, consumed, resumed = checkpoint_resume.start_from_checkpoint(checkpoint_context(run), log0)
    # Only now, with the config validated and any checkpoint loaded into this model, does the run dir record
    # it (a failed resume leaves the config of the run that wrote the checkpoint in place).
    if rt.rank == 0:
        write_config(cfg)
    done_note = None
    if resumed and step >= cfg.train.steps:  # said, not a silent "completed": exit 0, the run is where it asked
        done_note = (f"nothing to train: the checkpoint resumed from is at step {step} and train.steps="
                     f"{cfg.train.steps}; raise train.steps to train further")
        log0(f"[pretrain] {done_note}")

    # 4. Data.
    setup.build_data(cfg, run, step, writes_metrics=holds_the_loss(), consumed=consumed, log=log0)
    run_microbatches = _microbatch_runner(cfg, run)
    step_optimizer = profiler.wrap("optimizer", optimizer.step)
    res = resilience.Resilience(cfg, run, step, resumed, log0)  # skips, result checks, watchdog, stragglers
    # The profiler window, rank timing, MoE routing, the watchdog and stragglers, the step record and its sinks.
    observers = build_observers(cfg, run, res.observer())
    saves = _Saves(cfg, run, stops, last_saved=step if resumed else None, observers=observers)
    t = cfg.train

    def forward_backward() -> float:  # one run of the step (the rerun state machine may ask for two)
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        res.mark(resilience.FORWARD_BACKWARD)
        losses = run_microbatches(consumed, False, run.train_ds)
        res.mark(resilience.LOSS)
        return broadcast_from_last_stage(reduce_loss(losses) if losses else float("nan"), rt.device)

    # 5. Steps.
    first_step = step  # a non-finite result before this run's first update points at the config, not the LR
    try:
        while step < t.steps:
            if res.skipped(step + 1):  # consumed, not trained: the data order and LR schedule go on as if trained
                step, consumed = step + 1, consumed + t.global_batch_size
                scheduler.step(increment=1)
                if saves.save_or_stop(step, consumed):
                    break
                continue
            started = time.perf_counter()
            observers.step_start(step + 1)
            loss, rerun_record = res.run_step(step + 1, forward_backward)
            if not math.isfinite(loss) or (t.nan_policy == "skip" and not grads_are_finite(model)):
                what = f"loss {loss}" if not math.isfinite(loss) else "non-finite gradients"
                if t.nan_policy == "stop":
                    advice = (f"{first_step_cause(cfg)}." if step == first_step else
                              "lower optimizer.lr or set train.nan_policy=skip to skip such steps.")
                    raise TrainingStopped(f"step {step + 1}: {what}; stopping (train.nan_policy=stop). The last "
                                          f"checkpoint is intact; {advice}")
                log0(f"[pretrain] step {step + 1}: {what}; batch skipped (train.nan_policy=skip)")
                observers.step_skipped(step + 1)
                consumed += t.global_batch_size
                step += 1
                if saves.save_or_stop(step, consumed):
                    break
                continue
            res.mark(resilience.OPTIMIZER)
            ok, grad_norm, _ = step_optimizer()
            if ok:
                scheduler.step(increment=1)
                muon.after_step(cfg, model)  # QK-clip (optimizer.muon.qk_clip); nothing otherwise
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            if not math.isfinite(grad_norm) and t.nan_policy == "stop":
                cause = f" Note: {first_step_cause(cfg)}." if step == first_step else ""
                raise TrainingStopped(f"step {step + 1}: gradient norm {grad_norm}; stopping "
                                      f"(train.nan_policy=stop). The last checkpoint is intact.{cause}")
            step += 1
            consumed += t.global_batch_size
            observers.step_end(step, StepResult(loss, grad_norm, time.perf_counter() - started, consumed,
                                                extra=dict(rerun_record)))
            if t.eval_interval and step % t.eval_interval == 0 and run.evaluates:
                evaluate(cfg, run_microbatches, run.valid_ds, step, run.writer, rt.device)
            if saves.save_or_stop(step, consumed):
                break
        if cfg.checkpoint.save_at_end or saves.reason != "completed":
            saves.save(step, consumed)
        saves.finalize()
    except resilience.ResultRejected as exc:  # the model is still that of `step`, the last good one: saved
        saves.save(step, consumed)
        saves.finalize()
        res.rejected(cfg, exc, step, run.writer, rt.rank)
        raise
    except TrainingStopped as exc:
        saves.finalize()  # all ranks stop together here: commit the save in flight
        if rt.rank == 0:
            write_exit_status(cfg, "failed", step, None, str(exc))
        raise
    except BaseException as exc:
        saves.abort()
        with contextlib.suppress(AttributeError, TypeError):
            exc.last_step = step  # for exit_status.json (main)
        raise
    finally:
        observers.close(step)  # the resilience watch among them (watchdog off)
    if rt.rank == 0:
        write_exit_status(cfg, saves.reason, step, saves.signal_name, done_note)
    log0(f"[pretrain] {saves.reason} at step {step}; run dir {Path(cfg.run.dir).resolve()}")
    outputs.release()
    return {"reason": saves.reason, "step": step, "consumed_samples": consumed}


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

    Exit status: 2 invalid config, 3 stopped on purpose (NaN, a rejected result), 75 a hang (the watchdog's,
    pretrain/resilience/watchdog.py), 1 unusable checkpoint or run directory (or one
    another trainer holds), or a full / read-only / forbidden file system (the message names the path).
    """
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.run.run_dir import environment_error, exception_summary, os_error_line, record_failure, report_failure
    from pretrain.run.runtime import shutdown

    try:
        train(cfg)
        return 0
    except ValidationFailed as exc:
        print(exc.report(), file=sys.stderr, flush=True)
        return 2
    except output_lock.OutputLocked as exc:  # another writer's directory: none of its files is touched
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[pretrain] error: {exc}", file=sys.stderr, flush=True)
        return 1
    except TrainingStopped as exc:
        print(f"[pretrain] error: {exc}", file=sys.stderr, flush=True)
        return 3
    except resilience.ResultRejected as exc:  # a checkpoint of the last good step was saved
        print(f"[pretrain] error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except (CheckpointError, StorageError) as exc:
        return report_failure(cfg, str(exc), step=getattr(exc, "last_step", None))
    except Exception as exc:
        os_error = environment_error(exc)
        if os_error is None:
            # Not an expected failure: the traceback is the report, and exit_status.json says failed with its
            # one-line summary (never `running` after an exception this process saw).
            record_failure(cfg, exception_summary(exc), step=getattr(exc, "last_step", None))
            raise
        return report_failure(cfg, os_error_line(os_error), step=getattr(exc, "last_step", None))
    except BaseException as exc:  # KeyboardInterrupt and the like: recorded, then passed on
        if not isinstance(exc, SystemExit) or exc.code not in (0, None):
            record_failure(cfg, exception_summary(exc), step=getattr(exc, "last_step", None))
        raise
    finally:
        shutdown()
        output_lock.release_all()

