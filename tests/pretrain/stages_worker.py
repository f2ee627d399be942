"""`python -m pretrain train ARGV...` run again while it exits with 76 (a stage ended and the next one needs a new
process), as launch/common.sh and the docs' shell loop do: one pool case for a whole run in stages
(`tests.pool.run_case` with argv `train CONFIG [overrides]`).

Between two starts the process is put back as a new one would be (`tests.pool.server.reset_state`). Returns the last
start's exit status; OUT=path in the environment: the exit statuses of the starts, one JSON list.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from pretrain.__main__ import main as cli
    from pretrain.stages.boundaries import EXIT_NEXT_STAGE
    from tests.pool.server import reset_state

    args = sys.argv[1:] if argv is None else argv
    codes = [cli(list(args))]
    while codes[-1] == EXIT_NEXT_STAGE and len(codes) < 10:
        reset_state()
        codes.append(cli(list(args)))
    if os.environ.get("OUT") and int(os.environ.get("RANK", "0")) == 0:
        Path(os.environ["OUT"]).write_text(json.dumps(codes))
    return codes[-1]


if __name__ == "__main__":
    sys.exit(main())
