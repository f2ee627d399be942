"""Checkpoint save time vs training step time, synchronous and asynchronous (`torch_dist`).

    python benchmarks/checkpoint_save.py [--steps 12] [--interval 4] [override ...]
    torchrun --nproc-per-node 2 benchmarks/checkpoint_save.py parallel.tensor=2

Trains the tiny Llama twice through the real trainer (`pretrain.train.train`), once with
`checkpoint.async_save=false` and once with `true`, saving every `--interval` steps, and reports:
the time the training loop is blocked by a save call, the time until the checkpoint is committed (tracker
written), the step time without a save in flight and the step time while an asynchronous save is writing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _measure(overrides: list[str], async_save: bool, run_dir: Path) -> dict:
    import torch.distributed as dist

    from pretrain.checkpoint import format as checkpoint_format
    from pretrain.checkpoint import save as checkpoint_save
    from pretrain.config import load_config
    from pretrain.train import train

    blocked: list[float] = []
    started: dict[int, float] = {}
    committed: list[float] = []
    original_save, original_commit = checkpoint_save.save_checkpoint, checkpoint_save._commit

    def timed_save(*args, **kwargs):
        t0 = time.perf_counter()
        started[kwargs["step"]] = t0
        out = original_save(*args, **kwargs)
        blocked.append(time.perf_counter() - t0)
        return out

    def timed_commit(ctx, root, path, step):
        original_commit(ctx, root, path, step)
        committed.append(time.perf_counter() - started[step])

    checkpoint_save.save_checkpoint, checkpoint_save._commit = timed_save, timed_commit
    try:
        cfg = load_config("tiny_llama", overrides + [f"checkpoint.async_save={str(async_save).lower()}",
                                                     f"run.dir={run_dir}"])
        train(cfg)
    finally:
        checkpoint_save.save_checkpoint, checkpoint_save._commit = original_save, original_commit
    interval = cfg.checkpoint.interval
    size = sum(f.stat().st_size for f in checkpoint_format.iteration_dir(
        checkpoint_format.checkpoint_root(cfg), cfg.train.steps).iterdir())
    result = {"blocked_s": blocked, "commit_s": committed, "checkpoint_mb": size / 2**20}
    if dist.get_rank() == 0 and (run_dir / "metrics.jsonl").exists():
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        times = {m["step"]: m["step_time_s"] for m in lines if "step_time_s" in m}
        # Step 1 includes warm-up; steps right after a save run while an async save is writing.
        after_save = [times[s] for s in times if s > 1 and (s - 1) % interval == 0]
        quiet = [times[s] for s in times if s > 2 and (s - 1) % interval != 0]
        result["step_s_quiet"] = statistics.median(quiet) if quiet else None
        result["step_s_after_save"] = statistics.median(after_save) if after_save else None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from pretrain.run.runtime import init_distributed, shutdown

    rt = init_distributed()
    from pretrain.checkpoint.save import start_writer_helper

    start_writer_helper()  # a one-time start (a spawned process), outside both measurements
    base = [f"train.steps={args.steps}", f"checkpoint.interval={args.interval}", "checkpoint.keep_last=2",
            "logging.tensorboard=false", "logging.log_interval=1000", *args.overrides]
    results = {}
    with tempfile.TemporaryDirectory(prefix="ckpt_bench_") as tmp:
        # Both share one temporary dir root (rank 0's name broadcast so every rank writes to the same place).
        names = [tmp]
        dist.broadcast_object_list(names, src=0)
        for mode in ("sync", "async"):
            results[mode] = _measure(base, mode == "async", Path(names[0]) / mode)
        dist.barrier()
    shutdown()
    if rt.rank != 0:
        return 0
    s, a = results["sync"], results["async"]
    rows = [
        ("checkpoint size (MiB)", f"{s['checkpoint_mb']:.1f}", f"{a['checkpoint_mb']:.1f}"),
        ("training blocked per save (median s)", f"{statistics.median(s['blocked_s']):.3f}",
         f"{statistics.median(a['blocked_s']):.3f}"),
        ("save start → committed (median s)", f"{statistics.median(s['commit_s']):.3f}",
         f"{statistics.median(a['commit_s']):.3f}"),
        ("step time, no save in flight (median s)", f"{s['step_s_quiet']:.3f}", f"{a['step_s_quiet']:.3f}"),
        ("step time, step after a save (median s)", f"{s['step_s_after_save']:.3f}",
         f"{a['step_s_after_save']:.3f}"),
    ]
    print(f"world {rt.world_size}, overrides {args.overrides or '(tiny_llama defaults)'}")
    print("| | sync | async |\n|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":  # required: the async writer's multiprocessing Manager re-imports __main__
    sys.exit(main())
