"""The planner against published runs (`benchmarks/published_runs.yaml`): predicted vs measured tokens/s/GPU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pretrain.config import load_config
from pretrain.planner.cost import Cost
from pretrain.planner.plan import make_plan

RUNS = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.yaml"
TOLERANCE = 0.15  # the goal: every calibration row within ±15%


@dataclass
class Prediction:
    name: str
    published: float
    predicted: float
    fits: bool
    memory_gib: float
    capacity_gib: float
    calibration: bool
    step_s: float
    note: str

    @property
    def ratio(self) -> float:
        return self.predicted / self.published

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE


def load_runs(path: Path = RUNS) -> list[dict[str, Any]]:
    """The rows of the data file (each: name, config, overrides, nodes, gpus_per_node, gpu, published, ...)."""
    data = yaml.safe_load(path.read_text())
    runs = data["runs"]
    for r in runs:
        missing = {"name", "config", "overrides", "nodes", "gpus_per_node", "gpu", "published"} - set(r)
        if missing:
            raise ValueError(f"{path}: run {r.get('name', '?')!r} lacks {sorted(missing)}")
    return runs


def predict(run: dict[str, Any]) -> Prediction:
    """The plan of one published run: its tokens/s/GPU by the cost model and whether it fits."""
    cfg = load_config(run["config"], run["overrides"])
    plan = make_plan(cfg, run["nodes"], run["gpus_per_node"], run["gpu"], name=run["name"])
    fields = {k: v for k, v in plan["cost_model"].items() if k in Cost.__dataclass_fields__}
    cost = Cost(**fields)
    note = run.get("note", "")
    world = plan["world_size"]
    tokens = plan["layout"]["global_batch_size"] * cfg.model.seq_length
    return Prediction(run["name"], float(run["published"]), tokens / (cost.step_s * world), plan["fits"],
                      plan["memory_gib"]["total"], plan["gpu_memory_gib"], bool(run.get("calibration")),
                      cost.step_s, note)


def table(predictions: list[Prediction]) -> str:
    """Markdown table: predicted vs published, the ratio and the fit verdict."""
    lines = ["| run | published tok/s/GPU | predicted | ratio | within ±15% | memory (GiB) | fits | row |",
             "|---|---:|---:|---:|---|---:|---|---|"]
    for p in predictions:
        lines.append(f"| {p.name} | {p.published:,.0f} | {p.predicted:,.0f} | {p.ratio:.2f} | "
                     f"{'yes' if p.within else 'NO'} | {p.memory_gib:.1f} of {p.capacity_gib:.0f} | "
                     f"{'yes' if p.fits else 'NO'} | {'calibration' if p.calibration else 'check'} |")
    notes = [f"- {p.name}: {p.note}" for p in predictions if p.note]
    return "\n".join(lines + ([""] + notes if notes else []))
