"""`kill -9` of the trainer leaves no process behind: Megatron's checkpoint-writer Manager, multiprocessing's
resource tracker, the forked asynchronous writer and its write workers all end within seconds (issue 13
item 4). The killed run's `exit_status.json` says `running`, not an earlier run's `completed` (item 9).

Each trainer starts in its own session; every process of that session must be gone after the kill.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from tests.pretrain.ckpt_helpers import SMALL, command, kill_group, log_text, start, wait_until

pytestmark = pytest.mark.slow

ASYNC = SMALL + ["train.steps=500", "checkpoint.interval=2", "checkpoint.async_save=true"]


def _session(sid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def _describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        try:
            out.append(f"{proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:150]}")
        except psutil.Error:
            continue
    return out


def _kill_and_wait(proc, timeout: float = 10.0) -> float:
    """SIGKILL the trainer only (not its group); seconds until no process of its session is left."""
    sid = proc.pid
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    while time.monotonic() - started < timeout:
        if not _session(sid):
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"left behind {timeout:.0f} s after kill -9 of the trainer:\n"
                         + "\n".join(_describe(_session(sid))))


def test_kill9_after_saves_leaves_nothing_and_status_says_running(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    previous = {"reason": "completed", "step": 8, "signal": None, "message": None}
    (run_dir / "exit_status.json").write_text(json.dumps(previous) + "\n")  # an earlier run in this directory
    proc = start(command(ASYNC + [f"run.dir={run_dir}"]), tmp_path / "log")
    try:
        tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
        assert wait_until(tracker.exists, proc, timeout=300), log_text(tmp_path / "log")[-3000:]
        status = json.loads((run_dir / "exit_status.json").read_text())
        assert status["reason"] == "running" and status["pid"] == proc.pid, status
        helpers = [p for p in _session(proc.pid) if p.pid != proc.pid]
        kinds = " ".join(" ".join(p.cmdline()) for p in helpers)
        assert "multiprocessing.spawn" in kinds and "resource_tracker" in kinds, _describe(helpers)
        seconds = _kill_and_wait(proc)
        print(f"{len(helpers)} helper processes gone {seconds:.2f} s after kill -9 of the trainer")
        assert json.loads((run_dir / "exit_status.json").read_text())["reason"] == "running"
    finally:
        kill_group(proc)


def test_kill9_during_an_async_save_leaves_nothing(tmp_path):
    """The writer of the step-2 checkpoint hangs (a slow file system); the trainer is killed meanwhile."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"results": str(tmp_path / "results.json"), "cases": [
        {"name": "stall", "overrides": ASYNC + [f"run.dir={tmp_path}/run"], "stall_in_save": 2}]}))
    proc = start(command([], module="tests.pretrain.ckpt_worker", args=[str(plan)]), tmp_path / "log")
    try:
        trainer = psutil.Process(proc.pid)

        def writer_busy() -> bool:  # the forked writer and its forked write worker(s): the trainer's command line
            forked = 0
            for child in trainer.children(recursive=True):
                try:
                    forked += child.cmdline() == trainer.cmdline()
                except psutil.Error:
                    continue
            return forked >= 2

        assert wait_until(writer_busy, proc, timeout=300), log_text(tmp_path / "log")[-3000:]
        helpers = _session(proc.pid)
        seconds = _kill_and_wait(proc)
        print(f"{len(helpers) - 1} helper processes (writer busy) gone {seconds:.2f} s after kill -9 of the trainer")
    finally:
        kill_group(proc)
