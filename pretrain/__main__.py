"""`python -m pretrain {train,validate,plan,report} ...`"""

from __future__ import annotations

import argparse
import sys


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config (a path, or a name from pretrain/configs/ like tiny_llama)")
    p.add_argument("overrides", nargs="*", help="dotted overrides parsed as YAML, e.g. parallel.tensor=2")


def build_parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's own."""
    parser = argparse.ArgumentParser(prog="python -m pretrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train (or resume) a model; use torchrun for several processes")
    _config_args(p)
    p = sub.add_parser("validate", help="check a config and layout before launching (exit 2 on problems)")
    _config_args(p)
    p.add_argument("--world-size", type=int, default=None,
                   help="processes of the job (default: $WORLD_SIZE, else tensor×pipeline×context); given, on a "
                        "machine without CUDA, the job is checked as it runs on GPUs with Transformer Engine")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML")
    p.add_argument("--check-lock", action="store_true",
                   help="also exit 1 when a live trainer holds run.dir (its writer.lock); launch/common.sh uses it")
    p = sub.add_parser("plan", help="memory and throughput plan for a config and cluster", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p = sub.add_parser("report", help="plot and summarise runs (PNG)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    return parser, sub.choices


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = _parsers()
    if not argv or argv[0] not in commands:
        parser.parse_args(argv)  # -h, or a usage error naming the subcommands
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("plan", "report"):  # their own parsers (and their own -h)
        import importlib

        module = {"plan": "pretrain.plan", "report": "pretrain.observe.report"}[command]
        return importlib.import_module(module).main(rest)
    # Options and overrides in any order: `validate CONFIG --world-size 64 data.mock=true`.
    args = commands[command].parse_intermixed_args(rest)
    args.command = command

    from pretrain.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        from pretrain.run.once import let_rank0_say_it, rank

        if rank() == 0:  # every rank of a launch reads the same config: said once
            print(f"config error: {exc}", file=sys.stderr, flush=True)
        else:
            let_rank0_say_it()
        return 2

    if args.command == "validate":
        import os

        from pretrain.stages.plan import resolve_run

        p = cfg.parallel
        world = args.world_size
        if world is None:  # the launcher's (pretrain.run.runtime.env_world_size, which imports torch)
            world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else p.tensor * p.pipeline * p.context
            if cfg.stages and "WORLD_SIZE" not in os.environ:  # the largest model-parallel size of its stages
                from pretrain.stages.spec import derive

                world = max([world] + [s.cfg.parallel.tensor * s.cfg.parallel.pipeline * s.cfg.parallel.context
                                       for s in derive(cfg).stages])
        # An explicit --world-size is a dry run of the job: on a machine without CUDA, as on GPUs.
        # Every stage's config (the config itself without `stages`), all problems at once.
        staged = resolve_run(cfg, world, gpu_dry_run=args.world_size is not None)
        report = staged.report()
        from pretrain.rules.start import start_rules

        # What train will start from: a checkpoint's resume, or fresh (the stages share the keys that must match).
        if staged.plans:
            start_rules(report, staged.plans[0])
        if args.print_config:
            print(cfg.to_yaml())
        print(report.text(), file=sys.stdout if report.ok else sys.stderr)
        if not report.ok:
            return 2
        from pretrain.validate import store_verdicts

        for plan in staged.plans:  # into an existing cache only: validate creates no run.dir
            store_verdicts(plan.problems, plan.data.cache_dir, create=False)
        if args.check_lock:
            from pretrain.run.output_lock import run_outputs_held

            held = run_outputs_held(cfg)
            if held:
                print(f"[pretrain] error: {held}", file=sys.stderr, flush=True)
                return 1
        return 0

    from pretrain.train import main as train_main

    return train_main(cfg)


if __name__ == "__main__":
    sys.exit(main())
