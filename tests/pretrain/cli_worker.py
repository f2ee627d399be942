"""Run several `python -m pretrain ...` command lines in one process (start-up dominates on CPU).

    python -m tests.pretrain.cli_worker CASES.json RESULTS.json

CASES.json: {name: argv or {"argv": argv, "set": {...}}} (argv after `python -m pretrain`; see `run_case`).
Each case is `pretrain.__main__.main(argv)`, exactly what the CLI runs, with its stdout and stderr captured.
RESULTS.json: {name: {"rc": exit status, or null when an exception escaped (a traceback the user would see),
"stdout", "stderr", "traceback"}}.
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")


def run_cases(cases: dict, root, timeout: float = 300) -> dict[str, dict]:
    """Run `cases` as one pool case (`tests.pool`, one rank); return the results."""
    from pathlib import Path

    from tests.pool import run_case as pool_case
    from tests.pretrain.ckpt_helpers import log_text

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    plan, results, log = root / "cases.json", root / "results.json", root / "worker.log"
    plan.write_text(json.dumps(cases))
    rc = pool_case(1, "tests.pretrain.cli_worker", [str(plan), str(results)], log, timeout=timeout)
    assert rc == 0, log_text(log)[-4000:]
    return json.loads(results.read_text())


def run_case(case: list[str] | dict) -> dict:
    """One command line (`tests.cli.run_cli`); a dict case {"argv": [...], "set": {"module:NAME": value}} first
    sets module constants (e.g. a size threshold, to reach a path that otherwise needs a huge file)."""
    from tests.cli import run_cli

    argv, settings = (case, {}) if isinstance(case, list) else (case["argv"], case.get("set", {}))
    r = run_cli("pretrain", argv, patch=settings)
    if r.traceback is None:
        return {"rc": r.rc, "stdout": r.stdout, "stderr": r.stderr, "traceback": None}
    return {"rc": None, "stdout": r.stdout, "stderr": r.stderr[: len(r.stderr) - len(r.traceback)],
            "traceback": r.traceback}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cases = json.loads(open(argv[0]).read())
    results = {}
    for name, case in cases.items():
        results[name] = run_case(case)
        with open(argv[1], "w") as f:  # written after every case: a hang still leaves the others
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
