"""One writer per run directory (`pretrain/run/output_lock.py`), through `python -m pretrain train`: a second trainer
on a live run's `run.dir` is refused with one line naming the holder and touches nothing; after `kill -9` of the
holder, the restart takes the stale lock over (one note) and resumes. The staleness rules for other hosts, Slurm
requeues, pid reuse and unreadable records are tested through `data_tools` (tests/data_tools/test_writer_locks.py):
the same module decides for every writer.
"""

from __future__ import annotations

import json
import socket
import subprocess

import pytest

from tests.pretrain.ckpt_helpers import REPO, SMALL, _env, command, kill_group, log_text, metrics, start, wait_until

pytestmark = pytest.mark.slow


def test_second_trainer_refused_then_kill9_restart_takes_over(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMALL, "checkpoint.interval=2", f"run.dir={run_dir}"]
    first = start(command([*args, "train.steps=500"]), tmp_path / "first.log")
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        assert wait_until(tracker.exists, first, timeout=300), log_text(tmp_path / "first.log")[-3000:]
        records_before = (run_dir / "metrics.jsonl").read_text()
        second = subprocess.run(command([*args, "train.steps=500"]), cwd=REPO, env=_env(), capture_output=True,
                                text=True, timeout=300)
        assert first.poll() is None, "the first trainer stopped while the second ran"
        status = json.loads((run_dir / "exit_status.json").read_text())
        records_after = (run_dir / "metrics.jsonl").read_text()
    finally:
        kill_group(first)  # kill -9: the lock stays behind
        first.wait()

    assert second.returncode == 1, second.stdout + second.stderr
    assert "Traceback" not in second.stderr, second.stderr
    (line,) = [ln for ln in second.stderr.splitlines() if ln.startswith("[pretrain] error: ")]
    assert line.startswith(f"[pretrain] error: run.dir {run_dir} is in use by another writer: host "
                           f"{socket.gethostname()}, pid {first.pid}, no Slurm job, started "), line
    assert f"(lock {run_dir}/writer.lock, last heartbeat " in line, line
    # The first trainer's records are intact: nothing truncated, its status still its own.
    assert records_after.startswith(records_before) and records_before
    assert status["reason"] == "running" and status["pid"] == first.pid, status
    assert (run_dir / "writer.lock").exists()

    saved = int(tracker.read_text())
    third = subprocess.run(command([*SMALL, "checkpoint.interval=2", f"run.dir={run_dir}", f"train.steps={saved + 1}"]),
                           cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    (note,) = [ln for ln in third.stdout.splitlines() if "stale lock" in ln]
    assert note.startswith(f"[pretrain] note: took over the stale lock {run_dir}/writer.lock of host "
                           f"{socket.gethostname()}, pid {first.pid}, no Slurm job, started "), note
    assert note.endswith(f": process {first.pid} is not running"), note
    steps = [r["step"] for r in metrics(run_dir) if "loss" in r]
    assert steps == list(range(1, saved + 2)), steps  # the killed run's steps, then the resumed one
    assert json.loads((run_dir / "exit_status.json").read_text())["reason"] == "completed"
    assert not (run_dir / "writer.lock").exists()  # released at the end
