"""The planner's cost model against published runs: predicted vs published tokens/s/GPU, ratio, fit verdict.

    .venv/bin/python benchmarks/planner_vs_published.py [--runs benchmarks/published_runs.yaml] [--constants]

Reads the data file (Megatron-Bridge's performance summary rows: layout, GPUs, measured tokens/s/GPU), plans each
run with `pretrain.planner` and prints a Markdown table (docs/performance.md shows it). `--constants` also prints
the cost model's constants with their sources. Exit 1 when a calibration row is off by more than 15% or a run
that was measured is planned as not fitting.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pretrain.planner.constants import table as constants_table  # noqa: E402
from pretrain.planner.published import RUNS, load_runs, predict, table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=RUNS)
    ap.add_argument("--constants", action="store_true", help="print the constants table too")
    args = ap.parse_args(argv)
    predictions = [predict(r) for r in load_runs(args.runs)]
    print(table(predictions))
    if args.constants:
        print("\n| constant | value | unit | source |\n|---|---:|---|---|")
        for name, val, unit, source in constants_table():
            print(f"| `{name}` | {val:g} | {unit} | {source} |")
    bad = [p for p in predictions if (p.calibration and not p.within) or not p.fits]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
