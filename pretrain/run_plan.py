"""The run resolved once: `RunPlan`, built from the config before anything is built, frozen, and passed down.

    plan = resolve(cfg, world_size, data_files=False)   # train(); `validate` and `plan` resolve the same way

It holds what every later stage would otherwise derive again from the raw config: the parallel `Layout` (with
the padded vocabulary), which tokenizer the run uses (`TokenizerPlan`: null or files, identity, vocabulary, EOD),
the data plan (mock or blends, split, cache directory) and the problems pre-flight validation found. Set-up,
model building, the checkpoint contract and the loop read it; none of them calls the layout or tokenizer
resolution again (`RESOLUTIONS` counts both per process, and a test asserts one each for a training run).
"""

from __future__ import annotations

from dataclasses import dataclass

from model_providers.core.model_plan import ModelPlan, model_plan
from pretrain.config import Config
from pretrain.data.plan import DataPlan, data_plan
from pretrain.layout import RESOLUTIONS, Layout, derive_layout
from pretrain.problems import Report
from pretrain.tokenizer.choice import TokenizerPlan, decide

__all__ = ["DataPlan", "RunPlan", "TokenizerPlan", "for_cluster", "for_weights", "resolve", "resolve_tokenizer"]


@dataclass(frozen=True)
class RunPlan:
    """The config resolved for a job of `world_size` ranks (see the module docstring)."""

    cfg: Config
    world_size: int
    layout: Layout | None  # None when the sizes cannot hold a layout (then `problems` says why)
    tokenizer: TokenizerPlan
    data: DataPlan
    problems: Report
    model: ModelPlan  # what model building reads: `build_model(plan.model, plan.layout)`

    def layout_key(self) -> tuple:
        """What must be equal for per-rank state (RNG) to be restored; MoE adds expert parallel and expert TP."""
        lay = self.layout
        key = (lay.world, lay.tp, lay.pp, lay.vp, lay.cp)
        return key + (lay.ep, lay.etp) if self.cfg.model.num_moe_experts else key


def resolve_tokenizer(cfg: Config, data: DataPlan | None = None) -> TokenizerPlan:
    """Decide the run's tokenizer (`pretrain.tokenizer.choice.decide`, the one owner of that decision; `data`: the
    plan's data, for whether it is mock). Counted in `RESOLUTIONS`."""
    RESOLUTIONS["tokenizer"] += 1
    return decide(cfg.data, cfg.model.vocab_size, (data or data_plan(cfg)).mock, cfg.model.preset)


def resolve(cfg: Config, world_size: int, *, data_files: bool = True, **validate_kwargs) -> RunPlan:
    """Resolve `cfg` for `world_size` ranks once: the data plan (blends parsed), the tokenizer, the model plan, then
    validation (which derives the layout with the tokenizer's vocabulary and checks the three). Never raises for
    config problems: they are in `plan.problems`."""
    from pretrain.validate import check_planned

    data = data_plan(cfg)
    RESOLUTIONS["tokenizer"] += 1
    tokenizer = decide(cfg.data, cfg.model.vocab_size, data.mock, cfg.model.preset)
    model = model_plan(cfg)
    problems, layout = check_planned(cfg, world_size, vocab_size=tokenizer.vocab_size, tokenizer=tokenizer, data=data,
                                     model=model, data_files=data_files, **validate_kwargs)
    return RunPlan(cfg=cfg, world_size=world_size, layout=layout, tokenizer=tokenizer, data=data,
                   problems=problems, model=model)


def for_cluster(cfg: Config, world_size: int, *, use_te: bool, versions=None) -> RunPlan:
    """The plan of `cfg` on a GPU cluster of `world_size` ranks, for the planner (`python -m pretrain plan`): checked
    from the config alone as on GPUs (`use_te`: with Transformer Engine), its data as mock data (the data may live
    elsewhere); the layout is the one that check derives, with the tokenizer's vocabulary."""
    import copy

    planning = copy.deepcopy(cfg)
    planning.data.mock = True
    return resolve(planning, world_size, files=False, te_on_gpu=use_te, cuda_available=True, versions=versions)


def for_weights(cfg: Config, world_size: int, on_gpu: bool = False) -> RunPlan:
    """A plan for loading or converting weights outside a training run (the HF bridge, tools): the layout and the
    tokenizer, without pre-flight validation."""
    data = data_plan(cfg)
    tokenizer = resolve_tokenizer(cfg, data)
    layout = derive_layout(cfg, world_size, vocab_size=tokenizer.vocab_size, on_gpu=on_gpu, te=False)
    return RunPlan(cfg=cfg, world_size=world_size, layout=layout, tokenizer=tokenizer, data=data,
                   problems=Report(world_size), model=model_plan(cfg))
