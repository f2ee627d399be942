"""What the test run costs: every process a test launches and every pool case, with its seconds.

A pytest plugin (registered by `tests/conftest.py`). It wraps `subprocess.Popen` in the pytest process, so every
launch is seen whichever helper starts it (torchrun, `python -m pretrain`, a worker script, Slurm's `srun`), and
takes pool cases from `record_case`. At the end it prints, sorted by cost, the launches and cases, then the
totals per test file (launches, cases, process seconds, test seconds). `LAUNCH_LEDGER=FILE` also appends one
JSON line per launch, case and test as they end (readable while the run goes on).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Launches of our code: Python, torchrun, Slurm's launchers, make, shell scripts. Anything else (git, fc-list,
# shellcheck, Slurm's queries) is a tool call: not counted.
_LAUNCHERS = {"torchrun", "srun", "sbatch", "salloc", "make"}


def _is_launch(program: str) -> bool:
    return program.startswith("python") or program in _LAUNCHERS or program.endswith(".sh")


@dataclass
class Entry:
    kind: str  # "launch" | "case"
    test: str  # the test's node id ('' outside a test)
    label: str
    world: int
    seconds: float = 0.0
    t0: float = field(default=0.0, repr=False)


def _world(argv: list[str]) -> int:
    for i, a in enumerate(argv):
        for key in ("--nproc-per-node", "--nproc_per_node"):
            if a == key and i + 1 < len(argv):
                return int(argv[i + 1]) if argv[i + 1].isdigit() else 1
            if a.startswith(key + "="):
                value = a.split("=", 1)[1]
                return int(value) if value.isdigit() else 1
    return 1


def _label(argv: list[str]) -> str:
    """`torchrun -m pretrain train tiny_llama`, `python tests/pretrain/ckpt_worker.py killed`: the program and
    its first words, without ports, paths of run directories or overrides."""
    words = []
    for a in argv:
        if a.startswith("--master-port") or a.startswith("--rdzv") or "=" in a and not a.startswith("-"):
            continue
        words.append(Path(a).name if os.sep in a and not a.startswith("tests") else a)
        if len(words) >= 6:
            break
    return " ".join(words)


class Ledger:
    def __init__(self, out: str | None) -> None:
        self.entries: list[Entry] = []
        self.test_seconds: dict[str, float] = defaultdict(float)
        self.current = ""
        self.out = Path(out) if out else None
        self._orig_init = None
        self._orig_handle = None

    # -- recording --------------------------------------------------------------------------------------
    def _write(self, row: dict) -> None:
        if self.out is not None:
            with open(self.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    def _close(self, entry: Entry) -> None:
        if entry.t0:
            entry.seconds = time.monotonic() - entry.t0
            entry.t0 = 0.0
            if entry.kind != "tool":
                self._write({k: v for k, v in asdict(entry).items() if k != "t0"})

    def record_case(self, name: str, world: int, seconds: float) -> None:
        entry = Entry("case", self.current, name, world, seconds)
        self.entries.append(entry)
        self._write({k: v for k, v in asdict(entry).items() if k != "t0"})

    def install(self) -> None:
        ledger = self
        orig_init, orig_handle = subprocess.Popen.__init__, subprocess.Popen._handle_exitstatus
        self._orig_init, self._orig_handle = orig_init, orig_handle

        def __init__(proc, args, *a, **kw):  # noqa: N807
            orig_init(proc, args, *a, **kw)
            argv = [str(x) for x in (args if isinstance(args, (list, tuple)) else str(args).split())]
            program = Path(argv[0]).name if argv else ""
            kind = "launch" if _is_launch(program) else "tool"
            entry = Entry(kind, ledger.current, _label(argv), _world(argv), t0=time.monotonic())
            proc._ledger_entry = entry
            ledger.entries.append(entry)

        def _handle_exitstatus(proc, *a, **kw):
            result = orig_handle(proc, *a, **kw)
            entry = getattr(proc, "_ledger_entry", None)
            if entry is not None:
                ledger._close(entry)
            return result

        subprocess.Popen.__init__ = __init__
        subprocess.Popen._handle_exitstatus = _handle_exitstatus

    def uninstall(self) -> None:
        if self._orig_init is not None:
            subprocess.Popen.__init__ = self._orig_init
            subprocess.Popen._handle_exitstatus = self._orig_handle

    # -- pytest hooks -----------------------------------------------------------------------------------
    def pytest_runtest_logstart(self, nodeid, location):
        self.current = nodeid

    def pytest_runtest_logreport(self, report):
        self.test_seconds[report.nodeid] += report.duration
        if report.when == "teardown":
            self._write({"kind": "test", "test": report.nodeid, "seconds": round(self.test_seconds[report.nodeid], 2)})

    def pytest_terminal_summary(self, terminalreporter):
        for e in self.entries:  # still running (a leaked process): charge it up to now
            self._close(e)
        tr = terminalreporter
        costly = sorted((e for e in self.entries if e.kind != "tool"), key=lambda e: -e.seconds * e.world)
        if not costly and not self.test_seconds:
            return
        tr.section("launches and pool cases (most costly first: seconds x ranks)")
        tr.write_line(f"{'rank-s':>8} {'s':>7} {'world':>5} {'kind':<6} {'test':<60} what")
        for e in costly[:40]:
            tr.write_line(f"{e.seconds * e.world:8.1f} {e.seconds:7.1f} {e.world:5d} {e.kind:<6} "
                          f"{_short(e.test):<60} {e.label[:70]}")
        if len(costly) > 40:
            tr.write_line(f"... {len(costly) - 40} more")
        files: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
        for e in self.entries:
            if e.kind == "tool":
                continue
            row = files[_file(e.test)]
            row[0 if e.kind == "launch" else 1] += 1
            row[2] += e.seconds
        for nodeid, s in self.test_seconds.items():
            files[_file(nodeid)][3] += s
        tr.section("cost per test file")
        tr.write_line(f"{'test s':>8} {'launches':>8} {'cases':>6} {'process s':>10}  file")
        total = [0, 0, 0.0, 0.0]
        for name, row in sorted(files.items(), key=lambda kv: -kv[1][3]):
            tr.write_line(f"{row[3]:8.1f} {row[0]:8d} {row[1]:6d} {row[2]:10.1f}  {name or '(outside tests)'}")
            total = [t + r for t, r in zip(total, row)]
        tr.write_line(f"{total[3]:8.1f} {total[0]:8d} {total[1]:6d} {total[2]:10.1f}  TOTAL")


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _short(nodeid: str) -> str:
    return nodeid if len(nodeid) <= 60 else "..." + nodeid[-57:]


_LEDGER: Ledger | None = None


def record_case(name: str, world: int, seconds: float) -> None:
    """Count one pool case (the pools call this from the pytest process)."""
    if _LEDGER is not None:
        _LEDGER.record_case(name, world, seconds)


def configure(config) -> None:
    global _LEDGER
    if _LEDGER is None and not config.option.collectonly:
        _LEDGER = Ledger(os.environ.get("LAUNCH_LEDGER"))
        _LEDGER.install()
        config.pluginmanager.register(_LEDGER, "launch_ledger")


def unconfigure() -> None:
    if _LEDGER is not None:
        _LEDGER.uninstall()
