"""Several training runs in one torchrun launch, each through `pretrain.train.train(cfg)` (the API the README
documents), so a test pays the process start-up once:

    torchrun --nproc-per-node=N train_worker.py JOBS.json

JOBS.json: a list of [CONFIG_PATH, [KEY=VALUE, ...]]; each job is `load_config(CONFIG_PATH, overrides)` trained
to the end. Process groups are created once and reused; Megatron's model-parallel groups are rebuilt per job.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    jobs_file = (sys.argv[1:] if argv is None else argv)[0]
    from pretrain.config import load_config
    from pretrain.run.runtime import shutdown
    from pretrain.train import train

    try:
        for config, overrides in json.loads(Path(jobs_file).read_text()):
            train(load_config(config, overrides))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
