"""A profiler window over training steps: `logging.profile.{start_step,end_step,ranks}`.

On each profiled rank, steps start_step..end_step (1-based, as in metrics.jsonl) run under `torch.profiler` and
the Chrome trace is written to `run.dir/profile/rank<R>_steps<A>-<B>.json` (open in chrome://tracing or Perfetto).
Each step is a `step N` range with `data`, `forward_backward` and `optimizer` ranges inside. On GPU the window is
also bracketed by `torch.cuda.profiler.start()/stop()` (cudaProfilerStart/Stop) and the same ranges are NVTX
ranges, so Nsight Systems captures exactly that window:

    nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop -t cuda,nvtx,osrt \\
        -o prof_rank%q{RANK} torchrun ... -m pretrain train CONFIG logging.profile.start_step=10 ...

`logging.profile.memory=true` also records every tensor allocation and free in the trace and prints the window's
peak per device (`window_peaks`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path

import torch

from pretrain.files import atomic_path


class StepProfiler:
    """Starts/stops the profilers at the window's edges and marks steps and phases. A no-op elsewhere."""

    def __init__(self, profile_cfg, run_dir: str | os.PathLike, rank: int, on_gpu: bool):
        self.start = profile_cfg.start_step
        self.end = profile_cfg.end_step if profile_cfg.end_step is not None else self.start
        self.enabled = self.start is not None and rank in profile_cfg.ranks
        self.dir = Path(run_dir) / "profile"
        self.rank, self.on_gpu = rank, on_gpu
        self.memory = profile_cfg.memory
        self._prof = None
        self._first: int | None = None
        self._step_range = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def step_begin(self, step: int) -> None:
        """Before running step `step` (1-based). A resumed run inside the window profiles what is left of it."""
        if not self.enabled:
            return
        if self._prof is not None and self._step_range is not None:  # the previous step was skipped (NaN policy)
            self.step_end(step - 1)
        if self._prof is None and self.start <= step <= self.end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.on_gpu:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, profile_memory=self.memory)
            self._prof.start()
            self._first = step
            if self.on_gpu:
                torch.cuda.profiler.start()
        if self._prof is not None:
            self._step_range = self._range(f"step {step}")
            self._step_range.__enter__()

    def step_end(self, step: int) -> None:
        """After step `step` (its checkpoint and stop decision excluded); writes the trace after the last one."""
        if self._prof is None:
            return
        self._step_range.__exit__(None, None, None)
        self._step_range = None
        if step >= self.end:
            self._finish(step)

    def wrap(self, name: str, fn):
        """`fn` inside a `name` range while the window is open (a plain call otherwise)."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self._prof is None:
                return fn(*args, **kwargs)
            with self._range(name):
                return fn(*args, **kwargs)

        return wrapper

    def close(self, last_step: int) -> None:
        """The run stopped inside the window (signal, time limit, error): write what was profiled."""
        if self._prof is not None:
            if self._step_range is not None:
                self._step_range.__exit__(None, None, None)
                self._step_range = None
            self._finish(last_step)

    @contextlib.contextmanager
    def _range(self, name: str):
        if self.on_gpu:
            torch.cuda.nvtx.range_push(name)
        try:
            with torch.profiler.record_function(name):
                yield
        finally:
            if self.on_gpu:
                torch.cuda.nvtx.range_pop()

    def _finish(self, last: int) -> None:
        if self.on_gpu:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        prof, self._prof = self._prof, None
        prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}_steps{self._first}-{last}.json"
        with atomic_path(path) as tmp:
            prof.export_chrome_trace(str(tmp))
        print(f"[pretrain] rank {self.rank}: profile of steps {self._first}-{last} written to {path}", flush=True)
        if self.memory:
            peaks = ", ".join(f"{device} {n / 2**30:.3f} GiB" for device, n in window_peaks(path).items())
            print(f"[pretrain] rank {self.rank}: peak tensor memory in steps {self._first}-{last}: {peaks or 'none'} "
                  "(CPU: allocated in the window above what it held at its start; CUDA: the allocator's total)",
                  flush=True)


def window_peaks(trace: str | os.PathLike) -> dict[str, int]:
    """The largest "Total Allocated" of a Chrome trace's `[memory]` events, per device ("cpu", "cuda:N").

    torch.profiler's CPU count starts at the window (blocks allocated before it, weights and optimizer state,
    are not in it); CUDA's is the caching allocator's allocated total.
    """
    with open(trace) as f:
        events = json.load(f).get("traceEvents", [])
    peaks: dict[str, int] = {}
    for e in events:
        if e.get("name") != "[memory]":
            continue
        args = e.get("args", {})
        device = "cpu" if args.get("Device Type") == 0 else f"cuda:{args.get('Device Id', 0)}"
        peaks[device] = max(peaks.get(device, 0), int(args.get("Total Allocated", 0)))
    return peaks
