"""Launching real training processes for the checkpoint tests: timeouts, process groups, metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# Fields of a metrics line that do not depend on wall-clock time: compared exactly across runs.
DETERMINISTIC = ("step", "loss", "lr", "grad_norm", "consumed_samples")

# A CPU-sized run: 1.8 M parameters (vocabulary 4096 covers the mock dataset's token ids), fp32.
SMALL = ["model.seq_length=128", "model.vocab_size=4096", "train.global_batch_size=8",
         "train.micro_batch_size=2", "logging.tensorboard=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(overrides: list[str], nproc: int = 1, module: str = "pretrain", args: list[str] | None = None) -> list[str]:
    """`python -m pretrain train tiny_llama ...` (or torchrun for nproc > 1), or a worker module."""
    tail = ["-m", module] + (args if args is not None else ["train", "tiny_llama", *overrides])
    if nproc == 1:
        return [PYTHON, *tail]
    return [TORCHRUN, f"--nproc-per-node={nproc}", f"--master-port={free_port()}", *tail]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def kill_run(run_dir: Path) -> int:
    """SIGKILL every process whose command line names `run_dir`, and their children: the ranks a launcher left
    behind (a SIGSTOPped rank ignores its launcher's SIGTERM and, once the launcher is gone, is in no process group
    of the test's). Returns how many were killed."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and str(run_dir) in " ".join(p.info["cmdline"] or ()):
                found += [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
    for p in found:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(found, timeout=30)
    return len(found)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """Start in a new session (so the whole tree — ranks, checkpoint writers — can be ended at once)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    fh = open(log, "ab")
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> int:
    """Wait for the launcher; on timeout end its process group and fail. Leftovers are always ended."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()
        raise AssertionError(f"process {proc.args[:6]} timed out after {timeout} s") from None
    kill_group(proc)  # orphaned checkpoint-writer / Manager processes
    return rc


def run(cmd: list[str], log: Path, timeout: float = 240) -> int:
    return finish(start(cmd, log), timeout)


def metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def step_values(run_dir: str | Path, key: str) -> list[float]:
    """`key` of every training step's metrics line (validation lines have no loss), in step order."""
    return [x[key] for x in metrics(run_dir) if "loss" in x]


def max_rel(got: list[float], want: list[float]) -> float:
    """The largest relative difference of two equally long series."""
    assert len(got) == len(want), (got, want)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def by_step(run_dir: str | Path) -> dict[int, dict]:
    """The training-step records of `metrics.jsonl`, keyed by step."""
    return {m["step"]: m for m in metrics(run_dir) if "loss" in m}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def layout_case(root: Path, config: str, base: list[str], name: str, overrides: list[str], source: str | None) -> dict:
    """A worker case `name` training `config` in `root/name`; `source`: a run in `root` whose step-2 checkpoint it
    starts from."""
    case = {"name": name, "config": config, "overrides": base + overrides + [f"run.dir={root}/{name}"]}
    if source is not None:
        case["copy_from"] = [f"{root}/{source}", 2]
    return case


def deterministic(run_dir: str | Path) -> list[tuple]:
    return [tuple(rec[k] for k in DETERMINISTIC) for rec in metrics(run_dir) if "loss" in rec]


def wait_until(predicate: Callable[[], bool], proc: subprocess.Popen, timeout: float) -> bool:
    """Poll `predicate` until true; False when the process ended first. Fails on timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        if proc.poll() is not None:
            return predicate()
        time.sleep(0.05)
    kill_group(proc)
    raise AssertionError(f"condition not reached within {timeout} s")


def worker_ranks(proc: subprocess.Popen) -> dict[int, int]:
    """{RANK: pid} of the torchrun workers under the launcher `proc` (from /proc)."""
    import psutil

    ranks = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "RANK" in env and "LOCAL_RANK" in env and child.ppid() == proc.pid:
            ranks[int(env["RANK"])] = child.pid
    return ranks


def log_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def run_worker_cases(root: Path, world: int, cases: list[dict], timeout: float) -> dict:
    """`tests/pretrain/ckpt_worker.py` on `world` pool ranks for `cases` (one pool case); every case must succeed.
    Returns the worker's results by case name (plan and log under `root`); nothing is run for no cases."""
    from tests.pool import run_case

    if not cases:
        return {}
    plan = root / f"plan{world}.json"
    plan.write_text(json.dumps({"results": str(root / f"results{world}.json"), "cases": cases}))
    log = root / f"world{world}.log"
    rc = run_case(world, "tests.pretrain.ckpt_worker", [str(plan)], log, timeout=timeout)
    assert rc == 0, log_text(log)[-4000:]
    results = json.loads((root / f"results{world}.json").read_text())
    failed = {k: v["error"] for k, v in results.items() if not v["ok"]}
    assert not failed, failed
    return results


def linger_in_next_step(proc: subprocess.Popen, run_dir: str | Path, step: int, rng, most: float) -> None:
    """Once step `step`'s metrics line is written: wait a random time up to `most` seconds, but never past the line
    of step `step + 1` (nor the process's end). A line is written before its step's save, so a blow struck now lands
    in the save after step `step` or in step `step + 1`, however fast the steps run, never after a later save."""
    deadline = time.monotonic() + rng.uniform(0.0, most)
    while proc.poll() is None and time.monotonic() < deadline and len(metrics(run_dir)) <= step:
        time.sleep(0.01)


def kill9_and_resume(cmd: list[str], work: Path, steps: int, timeout: float = 600) -> int:
    """Run `cmd` (a training launch writing metrics to `work`), SIGKILL its process group at a random point after
    a random step before the last (in the step or the save after it), then run it again to completion (the resume).
    Returns the step after which it was killed."""
    import random

    rng = random.Random()
    kill_at = rng.randrange(1, steps)
    proc = start(cmd, work / "log")
    wait_until(lambda: len(metrics(work)) >= kill_at, proc, timeout=timeout)
    linger_in_next_step(proc, work, kill_at, rng, 0.5)
    if proc.poll() is None:
        kill_group(proc)
    finish(proc, timeout=60)
    rc = run(cmd, work / "log", timeout=timeout)
    assert rc == 0, log_text(work / "log")[-3000:]
    assert "resumed from" in log_text(work / "log")
    return kill_at
