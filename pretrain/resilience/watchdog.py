"""The per-rank hang watchdog: a thread that a step arms with a deadline and that, when the deadline passes,
writes every thread's Python stack to `run.dir/hang/stacks.rank<R>.txt` (faulthandler), this rank's record to
`run.dir/hang/rank<R>.json` (step, phase: the last collective region it entered), and, after a grace period in
which the other live ranks write theirs, `exit_status.json` (lowest live rank): reason `hang`, the step, the
ranks that stopped answering, each rank's last phase. Then the process exits with `HANG_EXIT`, which the Slurm
scripts requeue like a preemption (the run resumes from its last checkpoint).

Bound: `hang.factor` x the median of the recent step times, at least `hang.floor_s`; `hang.long_s` for the first
step a process runs, and between steps (checkpoint saves, evaluation, the stop agreement).
"""

from __future__ import annotations

import faulthandler
import json
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from pretrain.config import HangConfig
from pretrain.run.run_dir import HANG_DIR

# The regions of a step in the order a rank enters them (each but the first ends in collectives).
PHASES = ("step start", "forward/backward (pipeline send/recv, TP/CP/DP collectives)", "loss all-reduce",
          "optimizer step (gradient norm, parameter all-gather)", "after the step (checkpoint, evaluation, stop "
          "agreement all-reduce)")
HANG_EXIT = 75  # EX_TEMPFAIL: try again (launch/common.sh requeues it)
GRACE_S = 3.0  # the time the other live ranks have to write their records


class Watchdog:
    """`arm(step, phase, long=False)` before a region, `step_done(seconds)` after a step; `close()` at the end."""

    def __init__(self, h: HangConfig, run_dir: str, rank: int, world: int):
        self.h, self.rank, self.world = h, rank, world
        self.dir = Path(run_dir) / HANG_DIR
        self.times: deque[float] = deque(maxlen=20)
        self.step, self.phase, self.deadline, self.bound = 0, PHASES[0], None, 0.0
        self.started = self.armed_at = time.time()  # records of an earlier attempt in run.dir/hang/: older
        if os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "").startswith(str(self.dir)):  # launch/common.sh
            self.dir.mkdir(parents=True, exist_ok=True)  # NCCL's flight-recorder dumps land there
        # What else a rank may wait on, each a callable returning a record or None: the checkpoint writer of an
        # asynchronous save (`pretrain.checkpoint.save.AsyncSaves.in_flight`), named in the hang report.
        self.writers: list[Callable[[], dict | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pretrain-hang-watchdog", daemon=True)
        self._thread.start()

    def bound_s(self, long: bool) -> float:
        if long or not self.times:
            return self.h.long_s
        return max(self.h.floor_s, self.h.factor * statistics.median(self.times))

    def arm(self, step: int, phase: str, long: bool = False) -> None:
        self.step, self.phase = step, phase
        self.bound = self.bound_s(long)
        self.armed_at = time.time()
        self.deadline = time.monotonic() + self.bound

    def mark(self, phase: str) -> None:
        """The region the rank enters now (same deadline): named in the record when it hangs there."""
        self.phase = phase

    def step_done(self, seconds: float) -> None:
        self.times.append(seconds)

    def close(self) -> None:
        self._stop.set()
        self.deadline = None

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                self._fire()

    def _fire(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / f"stacks.rank{self.rank}.txt", "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        mine = {"rank": self.rank, "step": self.step, "phase": self.phase, "bound_s": round(self.bound, 3),
                "waited_s": round(time.time() - self.armed_at, 3),
                "pid": os.getpid(), "host": os.uname()[1], "time": time.time()}
        writer = self._writer()
        if writer is not None:
            mine["checkpoint_writer"] = writer
        (self.dir / f"rank{self.rank}.json").write_text(json.dumps(mine) + "\n")
        also = f"; {_writer_line(self.rank, writer)}" if writer is not None else ""
        print(f"[pretrain] hang: rank {self.rank} in step {self.step} ({self.phase}) for more than "
              f"{self.bound:.1f} s{also}; stacks in {self.dir}", flush=True)
        time.sleep(GRACE_S)
        records = {}
        for r in range(self.world):
            p = self.dir / f"rank{r}.json"
            try:
                record = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if record.get("time", 0) >= self.started - 60:
                records[r] = record
        if min(records) == self.rank:
            self._write_status(records)
        os._exit(HANG_EXIT)

    def _writer(self) -> dict | None:
        for probe in self.writers:
            try:
                found = probe()
            except Exception:  # noqa: BLE001 - the report goes on without it
                found = None
            if found is not None:
                return found
        return None

    def _write_status(self, records: dict[int, dict]) -> None:
        from pretrain.files import write_atomic
        from pretrain.run.run_dir import EXIT_STATUS_FILE

        # The ranks furthest on wait in a collective for the others: those behind them, or without a record (the
        # process is stopped or gone), stopped answering; a rank whose checkpoint writer has not finished holds
        # the others at the commit.
        def where(r: dict) -> tuple[int, int]:
            return r["step"], PHASES.index(r["phase"]) if r["phase"] in PHASES else -1

        front = max(where(r) for r in records.values())
        silent = sorted(r for r in range(self.world) if r not in records or where(records[r]) < front)
        writers = {r: rec["checkpoint_writer"] for r, rec in sorted(records.items()) if rec.get("checkpoint_writer")}
        behind = min(records.values(), key=where)
        step, after = behind["step"], behind["phase"] == PHASES[-1]
        last = {str(r): (f"{records[r]['phase']} (step {records[r]['step']})" if r in records else "no record")
                for r in range(self.world)}
        who = [f"rank(s) {', '.join(map(str, silent))} stopped answering"] if silent else []
        who += [_writer_line(r, w) for r, w in writers.items()]
        message = (f"hang {'after' if after else 'in'} step {step}: "
                   f"{'; '.join(who) or 'every rank waits at the same point (none is behind the others)'}; "
                   f"stacks in {self.dir}; resume from the last checkpoint")
        status = {"reason": "hang", "step": step if after else step - 1, "signal": None, "message": message,
                  "hang_step": step, "hang_ranks": silent or list(writers), "last_collective": last,
                  "hang_dir": str(self.dir)}
        if writers:
            status["hang_checkpoint_writers"] = {str(r): w for r, w in writers.items()}
        write_atomic(self.dir.parent / EXIT_STATUS_FILE, json.dumps(status) + "\n")
        print(f"[pretrain] {message}", flush=True)


def _writer_line(rank: int, writer: dict) -> str:
    """'the checkpoint writer of rank 1 (pid 41, sleeping; pid 57, stopped (SIGSTOP)) has not finished writing
    DIR (step 4)'."""
    processes = "; ".join(f"pid {pid}, {state}" for pid, state in writer["processes"])
    return (f"the checkpoint writer of rank {rank} ({processes}) has not finished writing {writer['checkpoint']} "
            f"(step {writer['iteration']})")
