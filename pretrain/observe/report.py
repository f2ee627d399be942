"""Plot and summarise training runs from their `metrics.jsonl`.

    python -m pretrain report RUN_DIR [RUN_DIR ...] [--out report.png]

One PNG with loss (validation loss dashed), learning rate, gradient norm and tokens/s/GPU against step,
one line per run (compare layouts, or a resumed run with its original), and a short text summary. A run in stages
(a `stage` field on its lines) has its stage boundaries marked: a dotted vertical line where a stage begins, named
on the loss panel, and its stages listed in the summary.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "grad norm"), ("throughput", "tokens/s/GPU"))


class ReportError(ValueError):
    """A run directory that cannot be reported on."""


def read_metrics(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training records, validation records) of a run, one per step (the last line for a step wins)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    train: dict[int, dict[str, Any]] = {}
    valid: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a killed run
        if "loss" in rec:
            train[step] = rec
        elif "valid_loss" in rec:
            valid[step] = rec
    if not train:
        raise ReportError(f"{path}: no training steps recorded")
    return [train[k] for k in sorted(train)], [valid[k] for k in sorted(valid)]


def throughput(rec: dict[str, Any]) -> float | None:
    """Tokens/s/GPU of a record (older records only have tokens/s)."""
    value = rec.get("tokens_per_s_per_gpu", rec.get("tokens_per_s"))
    return float(value) if value is not None else None


def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def stage_spans(train: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    """(stage, first step, last step) of each stage in a run's records, in order ([] without stages)."""
    spans: list[list] = []
    for rec in train:
        stage = rec.get("stage")
        if stage is None:
            continue
        if spans and spans[-1][0] == stage:
            spans[-1][2] = rec["step"]
        else:
            spans.append([stage, rec["step"], rec["step"]])
    return [tuple(s) for s in spans]


def summarize(name: str, train: list[dict[str, Any]], valid: list[dict[str, Any]]) -> str:
    """A few lines for one run. Throughput averages skip the first step (compilation, allocator warm-up)."""
    first, last = train[0], train[-1]
    steady = train[1:] or train
    parts = [f"{name}: steps {first['step']}-{last['step']} ({len(train)} logged)",
             f"loss {first['loss']:.4f} -> {last['loss']:.4f} (min {min(_finite([r['loss'] for r in train]) or [math.nan]):.4f})"]  # noqa: E501
    if valid:
        parts.append(f"valid loss {valid[-1]['valid_loss']:.4f} at step {valid[-1]['step']}")
    tok = _finite([throughput(r) for r in steady])
    if tok:
        parts.append(f"{statistics.mean(tok):,.0f} tokens/s/GPU")
    for key, label, fmt in (("tflops_per_gpu", "TFLOP/s/GPU", "{:.1f}"), ("mfu", "MFU", "{:.1%}")):
        vals = _finite([r.get(key) for r in steady])
        if vals:
            parts.append(f"{label} {fmt.format(statistics.mean(vals))}")
    mem = _finite([r.get("mem_gib") for r in train])
    if mem:
        parts.append(f"peak memory {max(mem):.1f} GiB")
    gn = _finite([r.get("grad_norm") for r in train])
    if gn:
        parts.append(f"grad norm last {gn[-1]:.3f} (max {max(gn):.3f})")
    spans = stage_spans(train)
    if spans:
        parts.append("stages " + ", ".join(f"{stage} {a}-{b}" for stage, a, b in spans))
    return "; ".join(parts)


def plot(runs: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]], out: Path) -> None:
    """Write the 2×2 figure of all runs to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    for (key, title), ax in zip(PANELS, axes.flat):
        for name, train, valid in runs:
            steps = [r["step"] for r in train]
            values = [throughput(r) if key == "throughput" else r.get(key) for r in train]
            pts = [(s, v) for s, v in zip(steps, values) if isinstance(v, (int, float)) and math.isfinite(v)]
            if pts:
                (line,) = ax.plot(*zip(*pts), label=name, linewidth=1.2)
                if key == "loss" and valid:
                    ax.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "--", marker="o",
                            markersize=3, color=line.get_color(), label=f"{name} (valid)")
        for _name, train, _valid in runs:  # stage boundaries: where each stage after the first begins
            for i, (stage, first, _last) in enumerate(stage_spans(train)):
                if i:
                    ax.axvline(first - 0.5, color="gray", linestyle=":", linewidth=1)
                if key == "loss":
                    ax.annotate(stage, (first - 0.5, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                                rotation=90, va="top", ha="right", color="gray")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _names(dirs: list[Path]) -> list[str]:
    """Short unique labels: the directory name, with its parent when names repeat."""
    names = [d.name or str(d) for d in dirs]
    if len(set(names)) < len(names):
        names = [f"{d.parent.name}/{d.name}" for d in dirs]
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    parser.add_argument("--out", default=None,
                        help="PNG to write (default: RUN_DIR/report.png for one run, ./report.png for several)")
    args = parser.parse_intermixed_args(argv)
    dirs = [Path(r) for r in args.runs]
    try:
        runs = [(name, *read_metrics(d)) for name, d in zip(_names(dirs), dirs)]
    except ReportError as exc:
        print(f"report error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (dirs[0] / "report.png" if len(dirs) == 1 else Path("report.png"))
    plot(runs, out)
    for name, train, valid in runs:
        print(summarize(name, train, valid))
    print(f"wrote {out}")
    return 0
