"""Who opens the dataset files and who builds Megatron's datasets: training cases in one torchrun launch, each
`pretrain.train.train(cfg)`, with spies that count (and then call) the real functions on every rank.

    torchrun --nproc-per-node 2 -m tests.pretrain.data_scale_worker CASES.json OUT.json

CASES.json: [{"name": ..., "config": ..., "overrides": [...]}, ...]. OUT.json (rank 0): per case and rank, the
calls of `check_dataset` (the pre-flight check of one prefix), of `GPTDataset.__init__` and of `numpy.save` (how
Megatron writes its index caches), and the error text of a case that failed validation.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections import Counter

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import numpy as np
    import torch.distributed as dist
    from megatron.core.datasets.gpt_dataset import GPTDataset

    import pretrain.dataset_format.check as check
    from pretrain.config import load_config
    from pretrain.run.runtime import shutdown
    from pretrain.train import train
    from pretrain.validate import ValidationFailed

    calls: Counter[str] = Counter()
    real_check, real_init, real_save = check.check_dataset, GPTDataset.__init__, np.save

    def counted_check(*args, **kwargs):
        calls["check_dataset"] += 1
        return real_check(*args, **kwargs)

    def counted_init(self, *args, **kwargs):
        calls["GPTDataset"] += 1
        real_init(self, *args, **kwargs)

    def counted_save(*args, **kwargs):
        calls["numpy.save"] += 1
        return real_save(*args, **kwargs)

    check.check_dataset = counted_check  # data_check imports it from the module at each call
    GPTDataset.__init__ = counted_init
    np.save = counted_save  # Megatron calls numpy.save through the module
    out = {}
    try:
        for case in json.loads(open(argv[0]).read()):
            calls.clear()
            error = None
            try:
                train(load_config(case["config"], case["overrides"]))
            except ValidationFailed as exc:
                error = exc.report()
            mine = {"calls": dict(calls), "error": error}
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            out[case["name"]] = every
    finally:
        check.check_dataset, GPTDataset.__init__, np.save = real_check, real_init, real_save  # a pool case
        if dist.is_initialized() and dist.get_rank() == 0:
            open(argv[1], "w").write(json.dumps(out))
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
