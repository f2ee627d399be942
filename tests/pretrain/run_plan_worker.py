"""Train through `pretrain.__main__.main` (the CLI) and record how often the layout and the tokenizer were resolved
in this process (`pretrain.layout.RESOLUTIONS`), and what an observer added to `pretrain.observe.observers.INSTRUMENTS`
(no edit of the loop) was told.

    torchrun --nproc-per-node N -m tests.pretrain.run_plan_worker CASES.json OUT_DIR

CASES.json: {name: argv after `python -m pretrain`}, run in order;
OUT_DIR/NAME.rank-R.json: {"rc", "resolutions", "events"}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from pretrain.__main__ import main as cli
    from pretrain.layout import RESOLUTIONS
    from pretrain.observe import observers

    events: list = []

    class Recorder(observers.Observer):
        def step_start(self, step):
            events.append(["start", step])

        def step_end(self, step, result):
            events.append(["end", step, sorted(result.extra)])

        def checkpoint(self, step, path):
            events.append(["checkpoint", step, Path(path).name])

        def close(self, step):
            events.append(["close", step])

    observers.INSTRUMENTS.append(lambda cfg, run: Recorder())

    args = sys.argv[1:] if argv is None else argv
    cases, out = json.loads(Path(args[0]).read_text()), Path(args[1])
    rank = int(os.environ.get("RANK", "0"))
    try:
        for name, case_argv in cases.items():
            RESOLUTIONS.clear()
            events.clear()
            rc = cli(case_argv)
            (out / f"{name}.rank-{rank}.json").write_text(json.dumps({"rc": rc, "resolutions": dict(RESOLUTIONS),
                                                                      "events": events}))
            if rc:
                return rc
    finally:
        observers.INSTRUMENTS.pop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
