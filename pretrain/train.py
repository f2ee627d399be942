"""The training loop on Megatron-Core, top to bottom.

    python -m pretrain train CONFIG [overrides]              # one process
    torchrun --nproc-per-node N -m pretrain train CONFIG ... # several

resolve (every stage validated) → the process (signals, process groups, data files, output lock) → for each stage
from the checkpoint's: set up (tokenizer → model chunks (layout-invariant init) → DDP → optimizer and LR schedule →
resume or pretrained weights → datasets → instruments) → the loop (forward/backward schedule, the batch of
Megatron's calculator, optimizer step, metrics, checkpoints, signals, time limit, NaN policy) → the stage's last
checkpoint (named for it: the next stage here, or exit 76) → exit status.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pretrain import compat
from pretrain.checkpoint import resume as checkpoint_resume
from pretrain.checkpoint import save as checkpoint_save
from pretrain.checkpoint.context import CheckpointContext
from pretrain.config import Config
from pretrain.observe.observers import StepResult, build_observers
from pretrain.resilience import hooks as resilience
from pretrain.resilience.results import first_step_cause
from pretrain.resilience.stops import RunSaves, StopRequests
from pretrain.run import output_lock, setup
from pretrain.run.once import let_rank0_say_it, rank
from pretrain.run.run_dir import EXIT_STATUS_FILE, StorageError, write_exit_status  # noqa: F401 (EXIT_STATUS_FILE)
from pretrain.run.steps import (  # noqa: F401 (forward_step: tests build the schedule with it)
    TrainingStopped,
    broadcast_from_last_stage,
    evaluate,
    forward_step,
    grads_are_finite,
    holds_the_loss,
    log0,
    microbatch_runner,
    reduce_loss,
)
from pretrain.stages import boundaries
from pretrain.stages.plan import StagedRun, resolve_run
from pretrain.stages.spec import Stage
from pretrain.validate import ValidationFailed


def printed_here(exc: BaseException) -> bool:
    """Whether this rank prints `exc`: a failure every rank meets with the same words (`every_rank`) is printed
    once, by rank 0, as `validate` prints it; any other by each rank that meets it."""
    return not getattr(exc, "every_rank", False) or rank() == 0


@dataclass
class _Process:
    """Set up once per process, before any stage: every stage resolved, runtime, signal handlers, output lock (the
    pre-flight report has passed and its verdicts are stored)."""

    staged: StagedRun
    rt: Any  # pretrain.run.runtime.Runtime
    stops: StopRequests
    outputs: Any  # pretrain.run.output_lock.RunOutputs


@dataclass
class _Start:
    """A stage set up (`_set_up`): its run, where it starts (resumed or not), and what the loop calls."""

    run: Any  # pretrain.run.setup.Run
    step: int
    consumed: int
    resumed: bool
    first_sample: int  # the stage's data begins at this sample
    done_note: str | None  # resumed at or past train.steps: said, the loop does nothing
    res: Any  # resilience.Resilience
    observers: Any  # pretrain.observe.observers.Observers
    saves: RunSaves


def train(cfg: Config) -> dict:
    """Run (or resume) training as configured: every stage of `stages:` (docs/training.md "Stages"), or the config
    as one. Returns a summary on every rank (reason "stage": the next stage needs a new process, exit 76). Start the
    process (every stage's plan resolved once, then its pre-flight) → the checkpoint's stage → from it, for each
    stage: `_run_stage` (`_set_up`, then the loop)."""
    process = _start_process(cfg)
    staged = process.staged
    try:
        summary = _train_stages(staged, process)
    finally:
        boundaries.leave()
    process.outputs.release()
    return summary


def _start_process(cfg: Config) -> _Process:
    """Pre-flight in this process: every stage resolved once (`resolve_run`: layout, tokenizer), every layout rule of
    every stage checked on every rank before any model-parallel group exists; the dataset files of every stage on
    rank 0 only, its verdict shared (all problems are reported together); then one writer per run directory."""
    from pretrain.data.datasets import check_data_files_once
    from pretrain.run.runtime import any_rank_error, env_world_size, init_distributed
    from pretrain.validate import store_verdicts

    staged = resolve_run(cfg, env_world_size(), data_files=False)  # each stage resolved once: layout, tokenizer
    first = staged.plans[0].cfg if staged.plans else cfg  # the first stage's config
    # Signal handlers first: Slurm's warning can arrive while the model and data are still being built.
    stops = StopRequests(first.train.exit_signal_handler, first.train.exit_duration_in_mins)
    timeout = resilience.pg_timeout_minutes(first.hang)  # the process groups' (the hang watchdog's bound)
    # Megatron-Core compatibility: CPU shims (no CUDA) and the fixes the installed release needs.
    compat.apply(on_gpu=torch.cuda.is_available())
    rt = init_distributed(timeout)
    for plan in staged.plans:
        check_data_files_once(plan, rt.device)
    problems = staged.report()
    if problems.errors:
        raise ValidationFailed(problems)
    if rt.rank == 0:  # validation passed: its full reads and Megatron-Core's checks are not repeated by later starts
        for cache_dir in dict.fromkeys(plan.data.cache_dir for plan in staged.plans):  # stages may share one
            store_verdicts(problems, cache_dir)
    # One writer per run directory: rank 0 locks run.dir before any file is written, every rank learns the verdict.
    outputs = output_lock.hold_run_outputs(first, rt.rank, any_rank_error, log0)
    return _Process(staged=staged, rt=rt, stops=stops, outputs=outputs)


def _train_stages(staged: StagedRun, process: _Process) -> dict:
    """Every stage from the one the run's checkpoint is in (decided before anything is built), in this process
    while the layout allows (else exit 76 names the next)."""
    from pretrain.run.runtime import reset_for_next_stage

    rt = process.rt
    stage = boundaries.resumed_stage(staged)
    while True:
        summary = _run_stage(staged, stage, process)
        if summary["reason"] != "stage_end":
            return summary
        following = staged.at(summary["step"])
        why = staged.new_process[staged.stages.index(stage)]
        if why is not None:  # its checkpoint is saved: the same command continues in the next stage
            summary["reason"] = "stage"
            message = (f"stage '{stage.name}' ended at step {summary['step']}; stage '{following.name}' {why}: "
                       f"run the same command again to continue (exit code {boundaries.EXIT_NEXT_STAGE})")
            if rt.rank == 0:
                write_exit_status(staged.plans[0].cfg.run.dir, "stage", summary["step"], None, message)
            log0(f"[pretrain] {message}")
            dist.barrier()
            return summary
        log0(f"[pretrain] stage '{stage.name}' ended at step {summary['step']}: stage '{following.name}' "
             "continues in this process, from that checkpoint")
        reset_for_next_stage()  # model, optimizer, data and Megatron's groups built again, as a restart would
        stage = following


def _set_up(staged: StagedRun, stage: Stage, process: _Process) -> _Start:
    """One stage (the whole run without stages) up to its first step: tokenizer and process groups, model,
    optimizer and schedule, the checkpoint it starts from, its data, and the loop's instruments."""
    from pretrain.run.run_dir import write_config

    rt, plan = process.rt, staged.plan(stage)
    cfg = plan.cfg
    run = setup.start_run(plan, rt, log0)  # tokenizer, process groups of plan.layout, run dir
    setup.build_training(run, log0)  # model, optimizer, schedule

    # Resume from run.dir's own checkpoint, else start from pretrained weights, else from scratch. A checkpoint
    # directory that cannot be written is found now, not at the first save.
    ctx = CheckpointContext(model=run.model, optimizer=run.optimizer, scheduler=run.scheduler, plan=run.plan)
    checkpoint_save.check_writable(ctx)
    step, consumed, resumed = checkpoint_resume.start_from_checkpoint(ctx, log0)
    # Only now, with the config validated and any checkpoint loaded into this model, does the run dir record
    # it (a failed resume leaves the config of the run that wrote the checkpoint in place).
    if rt.rank == 0:
        write_config(cfg)
    done_note = None
    if resumed and step >= cfg.train.steps:  # said, not a silent "completed": exit 0, the run is where it asked
        done_note = (f"nothing to train: the checkpoint resumed from is at step {step} and train.steps="
                     f"{cfg.train.steps}; raise train.steps to train further")
        log0(f"[pretrain] {done_note}")
    # The stage's data starts at its own first sample: the loop reads sample `consumed - first_sample` of it.
    saved = ctx.run_state if resumed else None  # the checkpoint's run-level state, read once by the resume
    first_sample = boundaries.enter(staged, stage, step, consumed, saved, log0)
    run.stage = stage if staged.staged else None
    setup.build_data(run, step, writes_metrics=holds_the_loss(), consumed=consumed - first_sample,
                     first_step=stage.start_step, log=log0)
    res = resilience.Resilience(cfg, run, step, saved, log0)  # skips, result checks, watchdog, stragglers
    # The profiler window, rank timing, MoE routing, the watchdog and stragglers, the step record and its sinks.
    observers = build_observers(cfg, run, res.observer())
    saves = RunSaves(ctx, rt.device, process.stops, last_saved=step if resumed else None, observers=observers)
    res.watch_saves(saves.async_saves)  # a hang report names a stalled checkpoint writer
    return _Start(run=run, step=step, consumed=consumed, resumed=resumed, first_sample=first_sample,
                  done_note=done_note, res=res, observers=observers, saves=saves)


def _run_stage(staged: StagedRun, stage: Stage, process: _Process) -> dict:
    """One stage: set up (`_set_up`), then its steps, to its end (the run's without stages), and its last checkpoint.
    Reason "stage_end": it ended at its boundary checkpoint and another stage follows. The global batch of each step
    is Megatron's calculator's at the samples consumed (train.rampup_batch_size: a ramp)."""
    start = _set_up(staged, stage, process)
    run, rt, res, observers, saves = start.run, process.rt, start.res, start.observers, start.saves
    model, optimizer, scheduler = run.model, run.optimizer, run.scheduler
    cfg, step, consumed, first_sample = run.plan.cfg, start.step, start.consumed, start.first_sample
    run_microbatches = microbatch_runner(run)
    t, m = cfg.train, cfg.model

    def forward_backward() -> float:  # one run of the step (the rerun state machine may ask for two)
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        res.mark(resilience.FORWARD_BACKWARD)
        losses = run_microbatches(consumed - first_sample, False, run.train_ds)
        res.mark(resilience.LOSS)
        return broadcast_from_last_stage(reduce_loss(losses) if losses else float("nan"), rt.device)

    ends = False
    try:
        while step < stage.end_step:
            batch = setup.advance_batch(run, consumed)
            if res.skipped(step + 1):  # consumed, not trained: the data order and LR schedule go on as if trained
                step, consumed = step + 1, consumed + batch
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
                    advice = (f"{first_step_cause(m, t.precision)}." if step == 0 else
                              "lower optimizer.lr or set train.nan_policy=skip to skip such steps.")
                    raise TrainingStopped(f"step {step + 1}: {what}; stopping (train.nan_policy=stop). The last "
                                          f"checkpoint is intact; {advice}")
                log0(f"[pretrain] step {step + 1}: {what}; batch skipped (train.nan_policy=skip)")
                observers.step_skipped(step + 1)
                consumed += batch
                step += 1
                if saves.save_or_stop(step, consumed):
                    break
                continue
            res.mark(resilience.OPTIMIZER)
            ok, grad_norm, _ = run.update()  # the optimizer step, then the LR schedule's and QK-clip
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            if not math.isfinite(grad_norm) and t.nan_policy == "stop":
                cause = f" Note: {first_step_cause(m, t.precision)}." if step == 0 else ""
                raise TrainingStopped(f"step {step + 1}: gradient norm {grad_norm}; stopping "
                                      f"(train.nan_policy=stop). The last checkpoint is intact.{cause}")
            step += 1
            consumed += batch
            observers.step_end(step, StepResult(loss, grad_norm, time.perf_counter() - started, consumed,
                                                extra=dict(rerun_record)))
            if t.eval_interval and step % t.eval_interval == 0 and run.evaluates:
                evaluate(t, partial(run_microbatches, n=run.layout.num_microbatches), run.valid_ds, step,
                         run.writer, rt.device)
            if saves.save_or_stop(step, consumed):
                break
        # A stage's last step: its checkpoint, named for it (kept), from which the next stage starts.
        ends = saves.reason == "completed" and step == stage.end_step < staged.spec.total_steps
        if ends or cfg.checkpoint.save_at_end or saves.reason != "completed":
            saves.save(step, consumed)
        saves.finalize()
        if ends:
            boundaries.name_boundaries(staged, step)
    except resilience.ResultRejected as exc:  # the model is still that of `step`, the last good one: saved
        saves.save(step, consumed)
        saves.finalize()
        res.rejected(exc, step, run.writer, rt.rank)
        raise
    except TrainingStopped as exc:
        saves.finalize()  # all ranks stop together here: commit the save in flight
        if rt.rank == 0:
            write_exit_status(cfg.run.dir, "failed", step, None, str(exc))
        raise
    except BaseException as exc:
        saves.abort()
        with contextlib.suppress(AttributeError, TypeError):
            exc.last_step = step  # for exit_status.json (main)
        raise
    finally:
        observers.close(step)  # the resilience watch among them (watchdog off)
    if ends:
        return {"reason": "stage_end", "step": step, "consumed_samples": consumed}
    if rt.rank == 0:
        write_exit_status(cfg.run.dir, saves.reason, step, saves.signal_name, start.done_note)
    log0(f"[pretrain] {saves.reason} at step {step}; run dir {Path(cfg.run.dir).resolve()}")
    return {"reason": saves.reason, "step": step, "consumed_samples": consumed}


def main(cfg: Config) -> int:
    """CLI entry: train, turning expected failures into one clear message and a non-zero exit.

    Exit status: 2 invalid config, 3 stopped on purpose (NaN, a rejected result), 75 a hang (the watchdog's,
    pretrain/resilience/watchdog.py), 76 a stage ended and the next one needs a new process (run the same command
    again: pretrain/stages/boundaries.py), 1 unusable checkpoint or run directory (or one
    another trainer holds), or a full / read-only / forbidden file system (the message names the path).
    """
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.run.run_dir import environment_error, exception_summary, os_error_line, record_failure, report_failure
    from pretrain.run.runtime import shutdown

    try:
        summary = train(cfg)
        return boundaries.EXIT_NEXT_STAGE if summary["reason"] == "stage" else 0
    except ValidationFailed as exc:  # every rank's: a silent rank waits for rank 0 to say it
        if printed_here(exc):
            print(exc.report(), file=sys.stderr, flush=True)
        else:
            let_rank0_say_it()
        return 2
    except output_lock.OutputLocked as exc:  # another writer's directory: none of its files is touched
        if rank() == 0:
            print(f"[pretrain] error: {exc}", file=sys.stderr, flush=True)
        return 1
    except TrainingStopped as exc:
        if printed_here(exc):
            print(f"[pretrain] error: {exc}", file=sys.stderr, flush=True)
        return 3
    except resilience.ResultRejected as exc:  # a checkpoint of the last good step was saved
        if printed_here(exc):
            print(f"[pretrain] error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except (CheckpointError, StorageError) as exc:
        return report_failure(cfg.run.dir, str(exc), step=getattr(exc, "last_step", None), printed=printed_here(exc))
    except Exception as exc:
        os_error = environment_error(exc)
        if os_error is None:
            # Not an expected failure: the traceback is the report, and exit_status.json says failed with its
            # one-line summary (never `running` after an exception this process saw).
            record_failure(cfg.run.dir, exception_summary(exc), step=getattr(exc, "last_step", None))
            raise
        return report_failure(cfg.run.dir, os_error_line(os_error), step=getattr(exc, "last_step", None))
    except BaseException as exc:  # KeyboardInterrupt and the like: recorded, then passed on
        if not isinstance(exc, SystemExit) or exc.code not in (0, None):
            record_failure(cfg.run.dir, exception_summary(exc), step=getattr(exc, "last_step", None))
        raise
    finally:
        shutdown()
        output_lock.release_all()

