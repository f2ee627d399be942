"""Train any config for N steps and print tokens/s/GPU, TFLOP/s/GPU, MFU and peak memory vs the plan.

    python benchmarks/train_throughput.py CONFIG [overrides] --steps 10 [--warmup 3] [--json-out F]
    torchrun --nproc-per-node 8 benchmarks/train_throughput.py CONFIG [overrides] --steps 10

The run uses the trainer itself (synthetic data unless the config sets a blend; no checkpoints, no
TensorBoard, a fresh temporary run directory), so the figures are the ones `metrics.jsonl` records,
averaged over the steps after the warm-up. Peak memory is `torch.cuda.max_memory_allocated()`, the
largest over ranks; "planned" is `python -m pretrain plan`'s most loaded rank for the same layout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")


def fused_adam_available() -> bool:
    """Megatron-Core uses TE's or apex's fused Adam when importable (no foreach temporaries)."""
    for module in ("transformer_engine.pytorch.optimizers", "apex.optimizers"):
        try:
            __import__(module)
            return True
        except Exception:
            continue
    return False


def planned_gib(cfg, world: int, on_gpu: bool) -> float | None:
    """The planner's peak for the most loaded rank of this layout (None when it cannot plan)."""
    from pretrain import plan
    from pretrain.layout import te_available, use_transformer_engine

    try:
        use_te = on_gpu and use_transformer_engine(cfg.model.transformer_impl, te_available())
        lay = plan.layout_of(cfg, world, on_gpu=on_gpu, use_te=use_te)
        vocab = plan.padded_vocab_for(cfg)
        return plan.most_loaded(cfg, lay, vocab, fused_adam=on_gpu and fused_adam_available()).total / plan.GIB
    except plan.PlanError:
        return None


def planned_activations_gib(cfg, world: int, on_gpu: bool) -> tuple[float, float] | None:
    """(activations at the peak, FP8 weight copies) the planner gives pipeline stage 0, in GiB."""
    from pretrain import plan
    from pretrain.layout import te_available, use_transformer_engine

    try:
        use_te = on_gpu and use_transformer_engine(cfg.model.transformer_impl, te_available())
        lay = plan.layout_of(cfg, world, on_gpu=on_gpu, use_te=use_te)
        vocab = plan.padded_vocab_for(cfg)
        act = plan.activation_memory(cfg, lay, vocab, 0)
        return act.peak / plan.GIB, plan.static_memory(cfg, lay, vocab, 0).fp8 / plan.GIB
    except plan.PlanError:
        return None


def summarize(records: list[dict], warmup: int) -> dict:
    """Means over the steps after the warm-up."""
    steady = [r for r in records if r["step"] > warmup] or records
    out = {"steps": len(records), "measured_steps": len(steady)}
    for key in ("tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "step_time_s", "loss"):
        vals = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        if vals:
            out[key] = statistics.mean(vals) if key != "loss" else vals[-1]
    return out


def format_row(label: str, r: dict) -> str:
    def f(key: str, fmt: str) -> str:
        return fmt.format(r[key]) if r.get(key) is not None else "n/a"

    return (f"{label:<34} {f('tokens_per_s_per_gpu', '{:,.0f}'):>12} {f('tflops_per_gpu', '{:.1f}'):>9} "
            f"{f('mfu', '{:.1%}'):>7} {f('peak_mem_gib', '{:.2f}'):>10} {f('planned_mem_gib', '{:.2f}'):>10} "
            f"{f('mem_ratio', '{:.2f}'):>6}")


HEADER = (f"{'run':<34} {'tokens/s/GPU':>12} {'TFLOP/s':>9} {'MFU':>7} {'peak GiB':>10} {'plan GiB':>10} "
          f"{'ratio':>6}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=None, help="steps left out of the means (default 3)")
    parser.add_argument("--label", default=None)
    parser.add_argument("--json-out", default=None, help="also write the figures as JSON here")
    parser.add_argument("--meter", action="store_true",
                        help="also count the bytes autograd saves for backward (pipeline stage 0) vs the plan")
    args = parser.parse_args(argv)
    if args.steps < 1:
        print("train_throughput: --steps must be at least 1", file=sys.stderr)
        return 2
    warmup = min(3, args.steps - 1) if args.warmup is None else args.warmup

    import torch
    import torch.distributed as dist

    from pretrain.config import ConfigError, load_config
    from pretrain.run.runtime import env_world_size, shutdown
    from pretrain.train import TrainingStopped, train
    from pretrain.validate import ValidationFailed

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    run_dir = Path(tempfile.gettempdir()) / f"train_throughput_{run_id}"
    forced = [f"train.steps={args.steps}", "checkpoint.save_at_end=false", "checkpoint.interval=null",
              "logging.tensorboard=false", "train.eval_interval=null", f"run.dir={run_dir}"]
    try:
        cfg = load_config(args.config, [*args.overrides, *forced])
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    on_gpu = torch.cuda.is_available()
    world = env_world_size()
    planned = planned_gib(cfg, world, on_gpu)
    meter = None
    if args.meter:
        from pretrain.planner.measure import SavedTensorMeter

        meter = SavedTensorMeter()
    try:
        if meter is not None:
            with meter:
                train(cfg)
        else:
            train(cfg)
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0],
                            device="cuda" if on_gpu else "cpu")
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        dist.barrier()
        if dist.get_rank() == 0:
            records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            result = summarize([r for r in records if "loss" in r], warmup)
            result["losses"] = [r["loss"] for r in records if "loss" in r]  # every step, for equality checks
            result.update(config=args.config, overrides=args.overrides, world_size=world,
                          device=torch.cuda.get_device_name() if on_gpu else "cpu",
                          peak_mem_gib=peak.item() if on_gpu else None, planned_mem_gib=planned,
                          mem_ratio=(peak.item() / planned) if (on_gpu and planned) else None)
            if meter is not None:
                act = planned_activations_gib(cfg, world, on_gpu)
                result.update(act_measured_gib=meter.peak / 2**30, act_planned_gib=act[0] if act else None,
                              fp8_planned_gib=act[1] if act else None)
            label = args.label or args.config
            print(HEADER)
            print(format_row(label, result))
            if args.json_out:
                Path(args.json_out).write_text(json.dumps({"label": label, **result}) + "\n")
    except ValidationFailed as exc:
        print(exc.report(), file=sys.stderr)
        return 2
    except TrainingStopped as exc:
        print(f"train_throughput: {exc}", file=sys.stderr)
        return 3
    finally:
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
