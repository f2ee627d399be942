"""`python -m pretrain plan ...`: argument parsing and exit codes."""

from __future__ import annotations

import argparse
import json
import sys

from pretrain.config import ConfigError, load_config
from pretrain.observe.flops import PEAK_TFLOPS
from pretrain.planner.common import DEFAULT_MFU, PlanError
from pretrain.planner.plan import make_plan
from pretrain.planner.report import format_plan, format_search
from pretrain.planner.search import search

DESCRIPTION = "Know before you launch: per-GPU memory, FLOPs and throughput of a config on a cluster."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pretrain plan", description=DESCRIPTION)
    p.add_argument("config", help="YAML config (a path, or a name from pretrain/configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor=2")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100", choices=sorted(PEAK_TFLOPS))
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="MFU the throughput figures assume")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--search", action="store_true", help="rank every valid layout that fits")
    p.add_argument("--top", type=int, default=5, help="layouts --search prints")
    p.add_argument("--stage", default=None, help="a run in stages: plan this stage's config (default: the stage "
                   "table)")
    return p


def _stage_config(cfg, name: str | None):
    """The config to plan: `cfg`, or with `--stage NAME` that stage's (`PlanError` naming the stages there are)."""
    if name is None:
        return cfg
    from pretrain.stages.spec import derive

    if not cfg.stages:
        raise PlanError(f"--stage {name}: this config has no stages")
    spec = derive(cfg)
    for stage in spec.stages:
        if stage.name == name:
            return stage.cfg
    if spec.problems:
        raise PlanError(f"{spec.problems[0].message} ({spec.problems[0].fix})")
    raise PlanError(f"--stage {name}: no such stage (stages: {', '.join(s.name for s in spec.stages)})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 1:
        print("plan error: --nodes and --gpus-per-node must be at least 1", file=sys.stderr)
        return 2
    if not 0 < args.mfu <= 1:
        print(f"plan error: --mfu {args.mfu} must be in (0, 1]", file=sys.stderr)
        return 2
    try:
        cfg = _stage_config(load_config(args.config, args.overrides), args.stage)
        if cfg.stages and not args.search:  # a run in stages: the stage table
            from pretrain.planner.stage_table import format_stage_table, stage_table

            table = stage_table(cfg, args.nodes, args.gpus_per_node, args.gpu, args.mfu, name=str(args.config))
            print(json.dumps(table, indent=1) if args.json else format_stage_table(table))
            return 0
        if cfg.stages:
            raise PlanError("--search plans one config: give --stage NAME to search a stage's layouts")
        if args.search:
            everything = search(cfg, args.nodes, args.gpus_per_node, args.gpu, top=0)
            best = everything[: args.top]
            if args.json:
                print(json.dumps({"layouts_considered_ok": len(everything), "top": best}, indent=1))
            else:
                print(format_search(best, len(everything)))
            if not everything:
                print(f"plan error: no layout passes validation and fits {args.nodes}×{args.gpus_per_node} "
                      f"{args.gpu.upper()}", file=sys.stderr)
                return 2
            return 0
        plan = make_plan(cfg, args.nodes, args.gpus_per_node, args.gpu, args.mfu, name=str(args.config))
    except (ConfigError, PlanError) as exc:
        print(f"plan error: {exc}", file=sys.stderr)
        return 2
    from pretrain.planner.stage_table import format_ramp, ramp_summary

    ramp = ramp_summary(cfg)  # a batch-size ramp: the batches it passes through (None without one)
    if ramp is not None:
        plan["rampup"] = ramp
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan) + (f"\n{format_ramp(ramp)}" if ramp else ""))
    return 0
