"""Every stage of a run resolved as a run of its own, and their problems in one report naming the stage.

    staged = resolve_run(cfg, world_size, data_files=False)   # train(); `validate` and `plan` the same way
    staged.report()                                           # every stage's problems at once
    staged.plans[stage.index]                                 # a stage's `pretrain.run_plan.RunPlan`

A config without `stages` is one unnamed stage: its plan and report are `resolve`'s own (one layout and one
tokenizer resolution, as before). With a ramp (`train.rampup_batch_size`), every global batch it passes through
in a stage must divide into that stage's micro batch × DP (the stage's layout: checked here, where both are
known, by `pretrain.rules.run.ramp_fits`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config import Config
from pretrain.problems import Problem, Report
from pretrain.rules.run import ramp_fits
from pretrain.run_plan import RunPlan, resolve
from pretrain.stages.spec import Stage, StagedConfig, derive


@dataclass(frozen=True)
class StagedRun:
    """The run's stages (`spec`), each one's `RunPlan` (in stage order) and the problems of the stages.
    `new_process`: for each stage, why the stage after it cannot start in this process (None: it can, or none
    follows)."""

    spec: StagedConfig
    plans: tuple[RunPlan, ...]
    world_size: int
    new_process: tuple[str | None, ...] = ()

    @property
    def staged(self) -> bool:
        return self.spec.staged

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.spec.stages

    def at(self, step: int) -> Stage:
        """The stage step `step` + 1 runs in."""
        return self.spec.at(step)

    def plan(self, stage: Stage) -> RunPlan:
        return self.plans[self.stages.index(stage)]

    def report(self) -> Report:
        """Every problem, note and warning of every stage (now: after the trainer's file checks too)."""
        if not self.staged:
            return self.plans[0].problems
        merged = Report(self.world_size, errors=list(self.spec.problems))
        named = [(stage.name, plan.problems) for stage, plan in zip(self.stages, self.plans)]
        everyone = len(named)
        groups: dict[tuple, tuple] = {}  # (kind, text) -> (the item, the stages that have it)
        for name, report in named:
            for kind, items in (("error", report.errors), ("warning", report.warnings), ("note", report.notes)):
                for item in items:
                    groups.setdefault((kind, str(item)), (item, []))[1].append(name)
            merged.ids_unchecked = merged.ids_unchecked or report.ids_unchecked
            merged.data_verdicts += report.data_verdicts
            merged.megatron_verdicts += report.megatron_verdicts
        for (kind, _), (item, names) in groups.items():
            label = _label(names, everyone)
            if kind == "error":
                merged.errors.append(Problem(item.keys, f"{label}: {item.message}", item.fix))
            else:
                (merged.warnings if kind == "warning" else merged.notes).append(f"{label}: {item}")
        return merged


def _label(names: list[str], everyone: int) -> str:
    if len(names) == everyone and everyone > 1:
        return "every stage"
    return f"stage '{names[0]}'" if len(names) == 1 else "stages " + ", ".join(f"'{n}'" for n in names)


def resolve_run(cfg: Config, world_size: int, **kwargs) -> StagedRun:
    """Resolve every stage of `cfg` for `world_size` ranks (`kwargs`: `pretrain.run_plan.resolve`'s). Never raises for
    config problems: `report()` holds them."""
    spec = derive(cfg)
    plans = []
    for stage in spec.stages:
        plan = resolve(stage.cfg, world_size, **kwargs)
        p = stage.cfg.parallel
        model_parallel = p.tensor * p.pipeline * p.context
        dp = plan.layout.dp if plan.layout is not None else (  # a GPU dry run derives none: the sizes tell it
            world_size // model_parallel if model_parallel > 0 and world_size % model_parallel == 0 else None)
        ramp_fits(plan.problems, stage.cfg.train, stage.batch_sizes, (stage.start_step + 1, stage.end_step), dp)
        plans.append(plan)
    handovers = [_new_process(a, b) for a, b in zip(plans, plans[1:])]
    return StagedRun(spec, tuple(plans), world_size, (*handovers, None) if plans else ())


def _new_process(a: RunPlan, b: RunPlan) -> str | None:
    """Why the stage planned by `b` cannot start in the process of the one before it (planned by `a`; None: it can):
    its process groups differ (the layout), or Transformer Engine's TP-overlap buffers, sized once per process,
    would. None where either has no layout (its problems stop the run first)."""
    if a.layout is None or b.layout is None:
        return None
    if a.layout_key() != b.layout_key():
        return f"changes the layout ({a.layout.describe()} → {b.layout.describe()})"
    pa, pb, ma, mb = a.cfg.parallel, b.cfg.parallel, a.cfg, b.cfg
    if (pa.tp_comm_overlap or pb.tp_comm_overlap) and (
            pa.tp_comm_overlap != pb.tp_comm_overlap or ma.model.seq_length != mb.model.seq_length
            or ma.train.micro_batch_size != mb.train.micro_batch_size):
        return "changes Transformer Engine's TP-overlap buffers (parallel.tp_comm_overlap)"
    return None

