"""`python -m pretrain plan` of a run in stages: one row per stage — its steps, tokens, sequence and batch, layout,
memory and time on the cluster — and the whole run's GPU-hours.

Each stage is planned as the config it trains with (`pretrain.stages.spec`: its `set` applied), on the same
cluster. A stage's time is its cost-model step time at its global batch, times its samples over that batch: the
steps of a batch-size ramp count pro rata to their batch (a step's time taken as proportional to its tokens).
"""

from __future__ import annotations

from typing import Any

from pretrain.config import Config
from pretrain.planner.common import PlanError
from pretrain.planner.plan import make_plan
from pretrain.problems import Report


def _layout(lay: dict[str, Any]) -> str:
    vp = f" VP{lay['virtual_pipeline']}" if lay["virtual_pipeline"] else ""
    cp = f"{lay['context']} {lay['cp_comm_type']}" if lay.get("cp_comm_type") else str(lay["context"])
    return f"TP{lay['tensor']}{' SP' if lay['sequence_parallel'] else ''} PP{lay['pipeline']}{vp} CP{cp} " \
           f"DP{lay['data']}"


def stage_table(cfg: Config, nodes: int, gpus_per_node: int, gpu: str, mfu: float,
                name: str | None = None) -> dict[str, Any]:
    """The stage table of `cfg` on nodes × gpus_per_node GPUs, JSON-ready (`PlanError` naming a stage's problem)."""
    from pretrain.rules.run import ramp_fits
    from pretrain.stages.spec import derive

    spec = derive(cfg)
    if spec.problems:
        raise PlanError("; ".join(f"{p.message} ({p.fix})" for p in spec.problems))
    world = nodes * gpus_per_node
    rows = []
    for stage in spec.stages:
        try:
            plan = make_plan(stage.cfg, nodes, gpus_per_node, gpu, mfu, name=stage.name)
        except PlanError as exc:
            raise PlanError(f"stage '{stage.name}': {exc}") from None
        lay, t = plan["layout"], stage.cfg.train
        ramp = Report(world)
        ramp_fits(ramp, t, stage.batch_sizes, (stage.start_step + 1, stage.end_step), lay["data"])
        if ramp.errors:
            raise PlanError(f"stage '{stage.name}': {ramp.errors[0].message}")
        seconds = plan["cost_model"]["step_s"] * stage.samples / t.global_batch_size
        rows.append({"name": stage.name, "first_step": stage.start_step + 1, "last_step": stage.end_step,
                     "steps": stage.steps, "samples": stage.samples, "tokens": stage.tokens,
                     "seq_length": stage.cfg.model.seq_length, "batch_sizes": list(stage.batch_sizes),
                     "layout": _layout(lay), "memory_gib": plan["memory_gib"]["total"], "fits": plan["fits"],
                     "step_s": plan["cost_model"]["step_s"], "hours": seconds / 3600,
                     "gpu_hours": seconds / 3600 * world, "set": {k: v for k, v in stage.sets.items()}})
    hours = sum(r["hours"] for r in rows)
    return {"config": name or cfg.model.preset or cfg.model.family, "gpu": gpu, "nodes": nodes,
            "gpus_per_node": gpus_per_node, "world_size": world,
            "stages": rows, "total": {"steps": spec.total_steps, "tokens": sum(r["tokens"] for r in rows),
                                      "hours": hours, "days": hours / 24, "gpu_hours": hours * world}}


def format_stage_table(table: dict[str, Any]) -> str:
    """The stage table as text for people."""
    lines = [f"plan: {table['config']} on {table['nodes']} node(s) × {table['gpus_per_node']} {table['gpu'].upper()} "
             f"= {table['world_size']} GPUs, {len(table['stages'])} stages",
             f"  {'stage':<12} {'steps':>17} {'tokens':>19} {'seq':>7} {'batch':>11} {'layout':<24} "
             f"{'mem GiB':>8} {'step s':>7} {'hours':>9} {'GPU-hours':>11}"]
    for r in table["stages"]:
        sizes = r["batch_sizes"]
        batch = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        fits = "" if r["fits"] else " (DOES NOT FIT)"
        lines.append(f"  {r['name']:<12} {r['first_step']:>8,}-{r['last_step']:<8,} {r['tokens']:>19,} "
                     f"{r['seq_length']:>7,} {batch:>11} {r['layout']:<24} {r['memory_gib']:>8.1f} "
                     f"{r['step_s']:>7.2f} {r['hours']:>9,.1f} {r['gpu_hours']:>11,.0f}{fits}")
    tot = table["total"]
    lines.append(f"  {'run':<12} {tot['steps']:>17,} {tot['tokens']:>19,} {'':>7} {'':>11} {'':<24} {'':>8} "
                 f"{'':>7} {tot['hours']:>9,.1f} {tot['gpu_hours']:>11,.0f}")
    lines.append(f"  {tot['days']:,.1f} days on {table['world_size']} GPUs at the cost model's step times (a ramp's "
                 "steps pro rata to their batch); each stage's full plan: plan CONFIG --stage NAME")
    for r in table["stages"]:
        if r["set"]:
            lines.append(f"  {r['name']} sets " + ", ".join(f"{k}={v}" for k, v in r["set"].items()))
    return "\n".join(lines)


def ramp_summary(cfg: Config) -> dict[str, Any] | None:
    """A config's batch-size ramp as `plan` shows it (None without one): the batches it passes through and the steps
    and samples before the global batch is reached."""
    from pretrain.stages.samples import ramp_steps, walk

    t = cfg.train
    if t.rampup_batch_size is None:
        return None
    steps, samples = ramp_steps(t.rampup_batch_size, t.global_batch_size)
    sizes = walk(t.rampup_batch_size, t.global_batch_size, 0, cfg.model.seq_length, steps=max(steps, 1)).batch_sizes
    return {"rampup_batch_size": list(t.rampup_batch_size), "batch_sizes": [*sizes, t.global_batch_size],
            "steps": steps, "samples": samples}


def format_ramp(ramp: dict[str, Any]) -> str:
    sizes = ", ".join(map(str, ramp["batch_sizes"]))
    return (f"  ramp-up    train.rampup_batch_size={ramp['rampup_batch_size']}: global batch {sizes} (Megatron-Core's "
            f"calculator); the target from step {ramp['steps'] + 1:,} ({ramp['samples']:,} samples before it)")
