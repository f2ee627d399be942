"""Exact resume: `kill -9` at random steps, a crash in the middle of a save, SIGUSR1 to one rank.

Every interrupted run is restarted with the same command until it completes; its metrics.jsonl must then
hold the same deterministic fields (step, loss, lr, grad_norm, consumed_samples — the same floats) as an
uninterrupted run, one line per step: no sample repeated or skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
from pathlib import Path

import psutil
import pytest

from tests.pool import run_case
from tests.pool.reference import reference_run
from tests.pretrain.ckpt_helpers import (
    SMALL,
    command,
    deterministic,
    finish,
    kill_group,
    linger_in_next_step,
    log_text,
    metrics,
    run,
    start,
    wait_until,
    worker_ranks,
)

# Resume is our code: the whole suite only (test_checkpointing.py runs save/load on the second release).
pytestmark = pytest.mark.slow

STEPS = 8
ONE_RANK = SMALL + [f"train.steps={STEPS}", "checkpoint.interval=2", "checkpoint.keep_last=2",
                    "optimizer.distributed=true"]
# Data parallel over 2 ranks, distributed optimizer, asynchronous saves every step.
TWO_RANKS = SMALL + ["train.steps=6", "checkpoint.interval=1", "checkpoint.keep_last=2", "checkpoint.async_save=true",
                     "optimizer.distributed=true"]
SEED = int(os.environ.get("RESUME_TEST_SEED", random.SystemRandom().randrange(10**6)))


def _tracker(run_dir: Path) -> int | None:
    f = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    return int(f.read_text()) if f.exists() else None


def _assert_same_run(run_dir: Path, reference: Path, steps: int) -> None:
    got, want = deterministic(run_dir), deterministic(reference)
    assert [g[0] for g in got] == list(range(1, steps + 1)), "a step is missing or repeated"
    assert [g[-1] for g in got] == [8 * s for s in range(1, steps + 1)], "a sample was repeated or skipped"
    assert got == want  # exact floats


@pytest.fixture(scope="module")
def one_rank_reference():
    """The uninterrupted run: one pool rank (`pretrain train`'s entry point), shared with the session's references."""
    root = reference_run("tiny_llama", ONE_RANK)
    assert len(deterministic(root)) == STEPS
    return root


def _kill_at(cmd: list[str], run_dir: Path, step: int, rng: random.Random, log: Path) -> int | None:
    """Start `cmd`, SIGKILL its process group in the save after step `step` or in step `step + 1`; the tracker
    then."""
    proc = start(cmd, log)
    reached = wait_until(lambda: len(metrics(run_dir)) >= step, proc, timeout=240)
    linger_in_next_step(proc, run_dir, step, rng, 0.6)
    if proc.poll() is None:
        kill_group(proc)
    finish(proc, timeout=60)
    assert reached, log_text(log)[-3000:]
    return _tracker(run_dir)


def test_kill9_at_random_steps_and_crash_while_saving_resume_identically(one_rank_reference, tmp_path):
    """One run directory, restarted with the same command after each blow: kill -9 at a random moment after step
    1, 2 or 3 and before step 4's save (CI once killed a run past that save, which left none to crash in), a SIGKILL
    of the process in the middle of writing step 4's checkpoint (the previous checkpoint, step 2, stays the one to
    resume from), kill -9 at a random later step (5-7), then run to the end: the metrics are the uninterrupted
    run's, exactly."""
    rng = random.Random(SEED)
    early, late = rng.randrange(1, 4), rng.randrange(5, STEPS)
    run_dir = tmp_path / "run"
    cmd = command(ONE_RANK + [f"run.dir={run_dir}"])
    trackers = [_kill_at(cmd, run_dir, early, rng, tmp_path / "early.log")]

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"results": str(tmp_path / "results.json"), "cases": [
        {"name": "crash", "overrides": ONE_RANK + [f"run.dir={run_dir}"], "crash_in_save": 4}]}))
    rc = run(command([], module="tests.pretrain.ckpt_worker", args=[str(plan)]), tmp_path / "crash.log", timeout=240)
    assert rc == -signal.SIGKILL, log_text(tmp_path / "crash.log")[-3000:]
    partial = run_dir / "checkpoints" / "iter_0000004"
    assert partial.is_dir() and not (partial / "metadata.json").exists()  # killed mid-write
    assert _tracker(run_dir) == 2
    assert len(metrics(run_dir)) == 4

    trackers.append(_kill_at(cmd, run_dir, late, rng, tmp_path / "late.log"))
    resumed = log_text(tmp_path / "late.log")
    assert "resumed from" in resumed and "iter_0000002 at step 2" in resumed, resumed[-3000:]
    rc = run(cmd, tmp_path / "log", timeout=240)
    assert rc == 0, log_text(tmp_path / "log")[-3000:]
    print(f"seed {SEED}: killed at steps {early} and {late}; trackers after each kill {trackers}")
    _assert_same_run(run_dir, one_rank_reference, STEPS)
    assert _tracker(run_dir) == STEPS
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("iter_*")) == ["iter_0000006", "iter_0000008"]


def test_signal_to_one_rank_then_kill9_two_ranks(tmp_path):
    """DP2 + async save: SIGUSR1 to rank 1 and the helpers → all ranks save and exit 0; kill -9 rank 0; resume."""
    ref = tmp_path / "ref"  # the uninterrupted run, on the 2-rank pool (the same entry point, no launch)
    rc = run_case(2, "pretrain.__main__", ["train", "tiny_llama", *TWO_RANKS, f"run.dir={ref}"], tmp_path / "ref.log",
                  timeout=300)
    assert rc == 0, log_text(tmp_path / "ref.log")[-3000:]

    work = tmp_path / "run"
    cmd = command(TWO_RANKS + [f"run.dir={work}"], nproc=2)
    proc = start(cmd, work / "log")
    wait_until(lambda: len(metrics(work)) >= 2, proc, timeout=300)
    ranks = worker_ranks(proc)
    assert sorted(ranks) == [0, 1], ranks
    # Like Slurm's step-wide signal, to rank 1 and every helper process (checkpoint writers, their
    # multiprocessing Manager) — not to rank 0, which learns of it from the other rank.
    helpers = [p.pid for p in psutil.Process(proc.pid).children(recursive=True) if p.pid not in ranks.values()]
    assert helpers, "no checkpoint helper processes found"
    for pid in [ranks[1], *helpers]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    rc = finish(proc, timeout=120)
    assert rc == 0, log_text(work / "log")[-3000:]
    status = json.loads((work / "exit_status.json").read_text())
    assert status["reason"] == "signal" and status["signal"] == "SIGUSR1", status
    assert 2 <= status["step"] < 6
    assert _tracker(work) == status["step"]  # saved (async save committed) before exiting
    assert len(metrics(work)) == status["step"]

    rng = random.Random(SEED)
    kill_at = rng.randrange(status["step"] + 1, 6)
    proc = start(cmd, work / "log")
    wait_until(lambda: len(metrics(work)) >= kill_at, proc, timeout=300)
    helpers: list[psutil.Process] = []
    linger_in_next_step(proc, work, kill_at, rng, 0.4)
    if proc.poll() is None:
        ranks = worker_ranks(proc)
        # torchrun starts each rank in its own session: ending the launcher's group does not reach these.
        for pid in ranks.values():
            with contextlib.suppress(psutil.Error):
                helpers += psutil.Process(pid).children(recursive=True)
        os.kill(ranks.get(0, proc.pid), signal.SIGKILL)
    rc = finish(proc, timeout=120)
    print(f"seed {SEED}: SIGUSR1 stop at step {status['step']}, kill -9 of rank 0 after step {kill_at}, "
          f"tracker then {_tracker(work)}")
    _, alive = psutil.wait_procs(helpers, timeout=10)
    assert not alive, f"checkpoint helpers outlived their ranks: {[p.pid for p in alive]}"

    rc = run(cmd, work / "log", timeout=300)
    assert rc == 0, log_text(work / "log")[-3000:]
    got, want = deterministic(work), deterministic(ref)
    assert [g[0] for g in got] == list(range(1, 7))
    assert got == want
