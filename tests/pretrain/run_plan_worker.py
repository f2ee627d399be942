"""Train through `pretrain.__main__.main` (the CLI) and record how often the layout and the tokenizer were resolved
in this process (`pretrain.layout.RESOLUTIONS`).

    torchrun --nproc-per-node N -m tests.pretrain.run_plan_worker CASES.json OUT_DIR

CASES.json: {name: argv after `python -m pretrain`}, run in order; OUT_DIR/NAME.rank-R.json: {"rc", "resolutions"}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from pretrain.__main__ import main as cli
    from pretrain.layout import RESOLUTIONS

    args = sys.argv[1:] if argv is None else argv
    cases, out = json.loads(Path(args[0]).read_text()), Path(args[1])
    rank = int(os.environ.get("RANK", "0"))
    for name, case_argv in cases.items():
        RESOLUTIONS.clear()
        rc = cli(case_argv)
        (out / f"{name}.rank-{rank}.json").write_text(json.dumps({"rc": rc, "resolutions": dict(RESOLUTIONS)}))
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
