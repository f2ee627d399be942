"""Run several training cases inside one torchrun launch (start-up dominates on CPU).

    torchrun --nproc-per-node N -m tests.pretrain.layout_worker CASES.json

CASES.json: [{"config": "tiny_llama", "overrides": ["parallel.tensor=2", ...]}, ...]. Each case is a full
`pretrain.train.train(cfg)`; model-parallel groups are rebuilt per case.
"""

from __future__ import annotations

import json
import sys
import warnings

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from pretrain.config import load_config
    from pretrain.run.runtime import shutdown
    from pretrain.train import train

    cases = json.loads(open(argv[0]).read())
    try:
        for case in cases:
            train(load_config(case["config"], case["overrides"]))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
