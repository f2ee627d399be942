"""The planner against Megatron-Bridge's published pre-training runs: predicted vs published tokens/s/GPU.

    .venv/bin/python benchmarks/planner_vs_published.py [--table FILE] [--json] [--by-model] [--constants]
    .venv/bin/python benchmarks/planner_vs_published.py --runs benchmarks/published_runs.yaml [--constants]

`--table FILE` (default: benchmarks/megatron_bridge_pretraining.tsv, Megatron-Bridge's published table, containers
25.09 .. 26.04.01) plans every data row with our shipped config for its model (benchmarks/published_models.yaml), the
row's layout, precision and batch, and the settings of its recipe (benchmarks/published_recipes.yaml); see
`pretrain/planner/published_table.py`. Without `--json`: a Markdown table (one line per row) and a summary line;
`--by-model` adds the per-(model, GPU) ratios and the held-out rows' residuals per GPU kind; `--twins` the rows
planned from equal inputs (one prediction each group, whatever the container: how many rows no model can meet) and
those equal but for the GPU kind (the published ratio between the GPUs against the predicted). With `--json`: one JSON
object per data row, one per line: `row` (0-based among the data rows), `predicted_tokens_per_s_per_gpu`, `fits`,
`flops_per_token`, `refused` (the reason, or null), and `erratum`: null, or where the row was planned with its release
recipe's layout because the table's cannot run or fit (benchmarks/published_recipes.yaml `errata`), that layout, its
source and why (also on its table line and in the summary line).

`--runs FILE`: the older data file of hand-written runs (config + overrides per run); exit 1 when a `calibration: true`
row is off by more than 15% or a measured run does not fit. `--constants` prints the cost model's constants with
their sources. A missing or malformed file: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pretrain.planner.constants import table as constants_table  # noqa: E402
from pretrain.planner.published import RUNS, load_runs, predict, table  # noqa: E402
from pretrain.planner.published_table import (  # noqa: E402
    MODELS,
    RECIPES,
    TABLE,
    TOLERANCE,
    Harness,
    RowPlan,
    as_planned,
    geometric_mean,
    must_miss,
    plan_row,
    read_table,
    summary,
    twins,
)


def _row_line(p: RowPlan) -> str:
    if p.refused:
        part = "held out" if p.held_out else ""
        return f"| {p.row} | {p.name} | {p.published:,.0f} | - | - | - | - | - | - | {part} | refused: {p.refused} |"
    flops = f"{p.flops_ratio:.3f}"
    memory = f"{p.memory_gib:.1f} of {p.capacity_gib:.0f} ({p.margin_gib:+.1f})"
    return (f"| {p.row} | {p.name} | {p.published:,.0f} | {p.predicted_tokens_per_s_per_gpu:,.0f} | {p.ratio:.2f} | "
            f"{'yes' if p.within else 'NO'} | {flops} | {memory} | {'yes' if p.fits else 'NO'} | "
            f"{'held out' if p.held_out else 'calibration'} | {p.placement or ''}"
            f"{'; does not fit: ' + p.overflow if p.overflow else ''}{'; ' + p.erratum if p.erratum else ''} |")


def row_table(plans: list[RowPlan]) -> str:
    """Markdown: one line per data row."""
    lines = ["| row | run | published tok/s/GPU | predicted | ratio | within ±15% | FLOPs ours / published | "
             "memory GiB (margin) | fits | part | placement / refusal |",
             "|---:|---|---:|---:|---:|---|---:|---|---|---|---|"]
    return "\n".join(lines + [_row_line(p) for p in plans])


def summary_line(plans: list[RowPlan]) -> str:
    s = summary(plans)
    fixed = [str(p.row) for p in plans if p.erratum and p.erratum.startswith("planned as")]
    errata = (f"; {_count(len(fixed), 'row')} ({', '.join(fixed)}) planned with the layout of the release's recipe "
              "where the table's cannot run or fit (benchmarks/published_recipes.yaml errata)") if fixed else ""
    return (f"{s['rows']} rows, {s['supported']} of supported models: {s['planned']} planned, {s['fit']} fit, "
            f"{s['within']} fit and within ±15% ({s['within'] / max(s['supported'], 1):.0%} of the supported), "
            f"FLOPs per token within ±3% on {s['flops_within']} of {s['planned']} planned{errata}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _figures(values) -> str:
    return "; ".join("-" if v is None else f"{v:,.0f}" for v in values)


def twins_report(rows: list, plans: list[RowPlan], harness: Harness) -> str:
    """Rows planned from equal inputs (the published spread; how many no prediction meets) and rows equal but for
    the GPU kind in one container (the published ratio between the GPUs against the predicted). A row planned with
    its erratum's layout is grouped by that layout."""
    rows = [as_planned(r, plans[r.index], harness) for r in rows]
    lines = ["| rows | run | published tok/s/GPU | predicted | published max / min | no model meets |",
             "|---|---|---:|---:|---:|---:|"]
    groups = twins(rows, harness)
    for g in groups:
        pub = [r.published for r in g]
        lines.append(f"| {', '.join(str(r.index) for r in g)} | {g[0].name.rsplit(' (', 1)[0]} | {_figures(pub)} | "
                     f"{_figures([plans[g[0].index].predicted_tokens_per_s_per_gpu])} | {max(pub) / min(pub):.2f} | "
                     f"{must_miss(g)} |")
    lines += ["", "| rows | run | GPUs | published tok/s/GPU | predicted | published ratio | predicted ratio |",
              "|---|---|---|---:|---:|---:|---:|"]
    across = twins(rows, harness, system=False)
    for g in across:
        pred = [plans[r.index].predicted_tokens_per_s_per_gpu for r in g]
        ratio = f"{pred[0] / pred[1]:.2f}" if len(g) == 2 and None not in pred else "-"
        published = f"{g[0].published / g[1].published:.2f}" if len(g) == 2 else "-"
        lines.append(f"| {', '.join(str(r.index) for r in g)} | {g[0].cells['model']} x{g[0].cells['gpus']} "
                     f"{g[0].cells['precision'].upper()} ({g[0].cells['container']}) | "
                     f"{', '.join(r.cells['system'] for r in g)} | {_figures(r.published for r in g)} | "
                     f"{_figures(pred)} | {published} | {ratio} |")
    missed = sum(must_miss(g) for g in groups)
    lines += ["", f"{_count(len(groups), 'group')} of rows planned from equal inputs ({sum(len(g) for g in groups)} "
                  f"rows): {_count(missed, 'row')} no model can meet (published more than "
                  f"{(1 + TOLERANCE) / (1 - TOLERANCE):.2f}x from its twins); {_count(len(across), 'group')} equal but "
                  "for the GPU kind"]
    return "\n".join(lines)


def by_model(plans: list[RowPlan]) -> str:
    """Per (model, GPU): rows, geometric-mean ratio, range; and the held-out rows' residuals per GPU kind."""
    groups: dict[tuple[str, str], list[RowPlan]] = defaultdict(list)
    for p in plans:
        if p.ratio is not None:
            groups[(p.model, p.system)].append(p)
    lines = ["| model | GPU | rows | geo-mean ratio | min | max | within ±15% and fit |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for (model, gpu), ps in sorted(groups.items()):
        rs = [p.ratio for p in ps]
        lines.append(f"| {model} | {gpu} | {len(ps)} | {geometric_mean(rs):.2f} | {min(rs):.2f} | {max(rs):.2f} | "
                     f"{sum(p.within and bool(p.fits) for p in ps)} |")
    lines += ["", "| GPU (held-out rows) | rows | median ratio | mean abs log residual | within ±15% | fit |",
              "|---|---:|---:|---:|---:|---:|"]
    held: dict[str, list[RowPlan]] = defaultdict(list)
    for p in plans:
        if p.held_out and p.ratio is not None:
            held[p.system].append(p)
    for gpu, ps in sorted(held.items()):
        rs = sorted(p.ratio for p in ps)
        mean_abs = sum(abs(math.log(r)) for r in rs) / len(rs)
        lines.append(f"| {gpu} | {len(ps)} | {rs[len(rs) // 2]:.2f} | {mean_abs:.3f} | {sum(p.within for p in ps)} | "
                     f"{sum(bool(p.fits) for p in ps)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", type=Path, default=None, help="a table in the published format (default: ours)")
    ap.add_argument("--json", action="store_true", help="one JSON object per data row")
    ap.add_argument("--by-model", action="store_true", help="per-(model, GPU) ratios and held-out residuals")
    ap.add_argument("--twins", action="store_true",
                    help="rows planned from equal inputs, and those equal but for the GPU kind")
    ap.add_argument("--models", type=Path, default=MODELS, help=argparse.SUPPRESS)
    ap.add_argument("--recipes", type=Path, default=RECIPES, help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=Path, nargs="?", const=RUNS, default=None,
                    help="the older hand-written data file instead (default benchmarks/published_runs.yaml)")
    ap.add_argument("--constants", action="store_true", help="print the constants table too")
    args = ap.parse_args(argv)
    if args.runs is not None:
        return _runs(args.runs, args.constants)
    path = args.table or TABLE
    try:
        rows = read_table(path)
        harness = Harness.load(args.models, args.recipes)
    except (OSError, ValueError, KeyError) as exc:
        print(f"planner_vs_published: {exc}", file=sys.stderr)
        return 2
    plans = [plan_row(r, harness) for r in rows]
    if args.json:
        for p in plans:
            print(json.dumps(p.json()))
        return 0
    print(row_table(plans))
    print()
    print(summary_line(plans))
    if args.by_model:
        print()
        print(by_model(plans))
    if args.twins:
        print()
        print(twins_report(rows, plans, harness))
    if args.constants:
        _print_constants()
    return 0


def _runs(path: Path, constants: bool) -> int:
    try:
        runs = load_runs(path)
    except (OSError, ValueError, KeyError) as exc:
        print(f"planner_vs_published: {exc}", file=sys.stderr)
        return 2
    predictions = [predict(r) for r in runs]
    print(table(predictions))
    if constants:
        _print_constants()
    bad = [p for p in predictions if (p.calibration and not p.within) or not p.fits]
    return 1 if bad else 0


def _print_constants() -> None:
    print("\n| constant | value | unit | source |\n|---|---:|---|---|")
    for name, val, unit, source in constants_table():
        print(f"| `{name}` | {val:g} | {unit} | {source} |")


if __name__ == "__main__":
    sys.exit(main())
