"""Stopping on purpose and the checkpoints of the loop: SIGTERM/SIGUSR1 and the wall-clock limit (`StopRequests`),
periodic and final saves with the stop decision all ranks agree on (`RunSaves`). `pretrain.train` uses both."""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from pretrain.checkpoint import save as checkpoint_save
from pretrain.checkpoint.context import CheckpointContext


def _log0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


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


class RunSaves:
    """Checkpoints during the loop: periodic and final saves (a step is saved once), asynchronous commits, and
    the stop decision all ranks agree on (signal or time limit), with the reason the run ends."""

    def __init__(self, ctx: CheckpointContext, device, stops: StopRequests, last_saved: int | None, observers):
        """`ctx`: what a save writes (its `settings`: the checkpoint section); `device`: this rank's (the agreed stop
        decision's all-reduce)."""
        self.ctx, self.device, self.stops, self.last_saved, self.observers = ctx, device, stops, last_saved, observers
        self.async_saves = checkpoint_save.AsyncSaves() if ctx.settings.async_save else None
        self.reason, self.signal_name = "completed", None

    def save(self, step: int, consumed: int) -> None:
        if self.last_saved == step:
            return
        t0 = time.perf_counter()
        path = checkpoint_save.save_checkpoint(self.ctx, step=step, consumed_samples=consumed,
                                               async_saves=self.async_saves)
        self.last_saved = step
        how = "started async save of" if self.async_saves is not None else "saved"
        _log0(f"[pretrain] {how} {path} in {time.perf_counter() - t0:.2f} s")
        self.observers.checkpoint(step, path)

    def save_or_stop(self, step: int, consumed: int) -> bool:
        """Periodic checkpoint, async-save commits, and the agreed stop decision (True: stop now)."""
        if self.async_saves is not None:
            self.async_saves.finalize(blocking=False)
        interval = self.ctx.settings.interval
        if interval and step % interval == 0:
            self.save(step, consumed)
        why, self.signal_name = self.stops.agreed_reason(self.device)
        if why is not None:
            self.reason = why
            _log0(f"[pretrain] {why}{f' ({self.signal_name})' if self.signal_name else ''} at step {step}: "
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
