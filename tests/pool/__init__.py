"""Case runner on persistent rank pools: worker-module cases without a process launch each.

`run_case(world, module, argv, log, timeout)` runs `module.main(argv)` on `world` ranks of a pool (one
`torchrun --nproc-per-node=W -m tests.pool.server` per world size, started at first use and kept for the
session) and returns its exit status: a drop-in for
`run(command([], nproc=world, module=module, args=argv), log, timeout)` of `tests.pretrain.ckpt_helpers`.
The protocol (files in the pool's directory) is in `tests/pool/server.py`. A pool that dies, hangs past a case's
timeout or ends a case with a non-zero status is ended (its whole process group); the next case starts a fresh one.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.pool.server import write_json
from tests.pretrain.ckpt_helpers import PYTHON, TORCHRUN, free_port, kill_group, log_text, start

POLL_S = 0.05
START_TIMEOUT_S = 300.0
GRACE_S = 10.0  # after one rank fails, how long the others get to report (torchrun would end them)
_ids = itertools.count()


@dataclass
class Pool:
    """One launch of `tests.pool.server` on `world` ranks."""

    world: int
    dir: Path
    proc: subprocess.Popen
    next_case: int = 0
    ready: bool = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """End the pool and everything it started (checkpoint writers, Managers)."""
        (self.dir / "stop").touch()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        kill_group(self.proc)
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict[int, Pool] = {}


def _start(world: int) -> Pool:
    pool_dir = Path(tempfile.mkdtemp(prefix=f"pool{world}-{next(_ids)}-"))
    tail = ["-m", "tests.pool.server", str(pool_dir)]
    cmd = [PYTHON, *tail] if world == 1 else [
        TORCHRUN, f"--nproc-per-node={world}", f"--master-port={free_port()}", *tail]
    return Pool(world, pool_dir, start(cmd, pool_dir / "server.log"))


def _wait_ready(pool: Pool) -> None:
    end = time.monotonic() + START_TIMEOUT_S
    while not all((pool.dir / f"ready.rank-{r}.json").exists() for r in range(pool.world)):
        if not pool.alive() or time.monotonic() > end:
            text = log_text(pool.dir / "server.log")[-3000:]
            stop_pool(pool.world)
            raise AssertionError(f"rank pool of {pool.world} did not start:\n{text}")
        time.sleep(POLL_S)
    pool.ready = True


def get_pool(world: int) -> Pool:
    pool = _POOLS.get(world)
    if pool is None or not pool.alive():
        if pool is not None:
            stop_pool(world)
        pool = _POOLS[world] = _start(world)
    return pool


def stop_pool(world: int) -> None:
    pool = _POOLS.pop(world, None)
    if pool is not None:
        pool.stop()


@atexit.register
def stop_all() -> None:
    """End every pool (session end; also atexit)."""
    for world in list(_POOLS):
        stop_pool(world)


def _server_log_size(pool: Pool) -> int:
    path = pool.dir / "server.log"
    return path.stat().st_size if path.exists() else 0


def _report_pool_end(pool: Pool, log: Path, offset: int) -> None:
    """What the pool's launcher printed since `offset` (torchrun's report of a rank killed by a signal, "Signal 11
    (SIGSEGV) received by PID ...", which the rank itself cannot print), appended to the case's log before the
    pool and its log are removed. A rank that is gone gets its launcher a moment to notice and say so."""
    if pool.alive():
        with contextlib.suppress(subprocess.TimeoutExpired):
            pool.proc.wait(timeout=GRACE_S)
    path = pool.dir / "server.log"
    if not path.exists():
        return
    with path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace").strip()
    if text:
        with log.open("a") as out:
            out.write(f"\n[pool] the rank pool's launcher printed during this case:\n{text}\n")


def _ranks_done(pool: Pool, n: int) -> dict[int, dict]:
    done = {}
    for r in range(pool.world):
        path = pool.dir / f"case-{n}.rank-{r}.json"
        if path.exists():
            done[r] = json.loads(path.read_text())
    return done


def run_case(world: int, module: str, argv: list[str], log: str | Path, timeout: float, name: str | None = None,
             env: dict[str, str] | None = None) -> int:
    """Run `module.main(argv)` on `world` pool ranks, their output appended to `log`; the exit status (the
    highest of the ranks'). Fails (AssertionError with the log's tail) when the pool dies or `timeout` passes."""
    from tests import launch_ledger

    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    name = name or f"{module.rsplit('.', 1)[-1]} {log.name}"
    started = time.monotonic()
    pool = get_pool(world)
    if not pool.ready:
        _wait_ready(pool)
    n = pool.next_case
    pool.next_case += 1
    offset = _server_log_size(pool)
    write_json(pool.dir / f"case-{n}.json",
               {"module": module, "argv": [str(a) for a in argv], "env": env or {}, "log": str(log), "name": name})
    end, failed_at = started + timeout, None
    while True:
        done = _ranks_done(pool, n)
        if len(done) == world:
            break
        if failed_at is None and any(d["rc"] != 0 for d in done.values()):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            break  # the other ranks wait in a collective for the failed one
        if not pool.alive() or time.monotonic() > end:
            why = f"timed out after {timeout:.0f} s" if pool.alive() else f"pool exited ({pool.proc.poll()})"
            if not pool.alive():  # (a hang gets no launcher report)
                _report_pool_end(pool, log, offset)
            stop_pool(world)
            launch_ledger.record_case(name, world, time.monotonic() - started)
            raise AssertionError(f"pool case {name!r} on {world} rank(s): {why}\n{log_text(log)[-4000:]}")
        time.sleep(POLL_S)
    rc = max([d["rc"] for d in done.values()] + ([1] if len(done) < world else []))
    retired = sorted({d["retire"] for d in done.values() if d.get("retire")})
    if len(done) < world:
        _report_pool_end(pool, log, offset)  # a rank did not report: it died, and the launcher says how
    if rc != 0 or retired:
        stop_pool(world)  # its state may be poisoned (or worn out); the next case starts a fresh pool
    # The ledger names why a pool ended after this case: each restart costs the next case a pool start.
    ended = f" [pool ended: rc {rc}]" if rc != 0 else f" [pool retired: {', '.join(retired)}]" if retired else ""
    launch_ledger.record_case(name + ended, world, time.monotonic() - started)
    return rc

