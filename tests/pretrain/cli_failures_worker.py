"""Runs several `python -m pretrain ...` command lines in one process: `cli_failures_worker.py PLAN.json`.

Each case calls the CLI's entry point, `pretrain.__main__.main(argv)`, with stdout and stderr captured, so
many failure cases cost one interpreter start. PLAN.json: {"results": path, "cases": [case, ...]}; a case:
    name     label in the results file
    argv     the command line after `python -m pretrain`
    setup    [[op, path, arg...], ...] run first, paths absolute: copy (arg: source directory), the
             mutations of ckpt_worker.py (truncate, delete, evil_pickle, write, write_bytes, nan), and
             noop ("module:function" replaced by a no-op for the case, e.g. a validation rule switched off)
Results: {name: {"rc": exit status, "stdout": str, "stderr": str, "escaped": traceback or None}}, where
`escaped` is an exception that left `main` (the real CLI would print it as a traceback).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run_case(case: dict) -> dict:
    from pretrain.__main__ import main
    from pretrain.run.runtime import _free_port
    from tests.pretrain.ckpt_worker import _mutate

    restore = []
    for op, path, *args in case.get("setup", []):
        if op == "noop":  # path "module:name": a function replaced by a no-op for this case (a validation rule
            import importlib  # switched off to reach what happens after a check validate would have made)

            module, name = path.split(":")
            mod = importlib.import_module(module)
            if hasattr(mod, name):  # absent: off already (an older tree)
                restore.append((mod, name, getattr(mod, name)))
                setattr(mod, name, lambda *a, **k: None)
        elif op == "copy":
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(args[0], path)
        else:
            _mutate("/", [[op, path, *args]])
    os.environ["MASTER_PORT"] = str(_free_port())  # a fresh rendezvous per case
    out, err = io.StringIO(), io.StringIO()
    rc, escaped = None, None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(case["argv"]))
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: B036 — recorded for the test: the CLI would show a traceback
            escaped = traceback.format_exc()
    for mod, name, value in restore:
        setattr(mod, name, value)
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(), "escaped": escaped}


def main(argv: list[str] | None = None) -> int:
    plan_path = (sys.argv[1:] if argv is None else argv)[0]
    plan = json.loads(Path(plan_path).read_text())
    results: dict = {}
    for case in plan["cases"]:
        results[case["name"]] = run_case(case)
        Path(plan["results"]).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":  # the async checkpoint writer re-imports __main__
    sys.exit(main())
