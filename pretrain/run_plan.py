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
from typing import Any

from model_providers.core.model_plan import ModelPlan, model_plan
from pretrain.config import Config
from pretrain.layout import RESOLUTIONS, Layout, derive_layout
from pretrain.problems import Report


@dataclass(frozen=True)
class TokenizerPlan:
    """Which tokenizer the run uses, decided once: the null tokenizer of mock data without files, or files."""

    null: bool
    identity: Any  # pretrain.tokenizer.identity.TokenizerIdentity; None when it cannot be known (reported)
    error: str | None = None  # why the identity is unknown (None when it is known)

    @property
    def vocab_size(self) -> int | None:
        return self.identity.vocab_size if self.identity is not None else None

    @property
    def eod(self) -> int | None:
        return self.identity.eod if self.identity is not None else None

    def record(self) -> dict | None:
        """What a checkpoint records about the tokenizer (None: no tokenizer known)."""
        return self.identity.to_dict() if self.identity is not None else None


@dataclass(frozen=True)
class DataPlan:
    """Where the tokens come from: mock data or blends (per split), and Megatron's index-cache directory."""

    mock: bool
    blends: dict  # "data.blend" / "data.train_blend" / ... -> (prefixes, weights or None)
    split: str
    cache_dir: str


@dataclass(frozen=True)
class RunPlan:
    """The config resolved for a job of `world_size` ranks (see the module docstring)."""

    cfg: Config
    world_size: int
    layout: Layout | None  # None when the sizes cannot hold a layout (then `problems` says why)
    tokenizer: TokenizerPlan | None
    data: DataPlan
    problems: Report
    model: ModelPlan  # what model building reads: `build_model(plan.model, plan.layout)`

    def layout_key(self) -> tuple:
        """What must be equal for per-rank state (RNG) to be restored; MoE adds expert parallel and expert TP."""
        lay = self.layout
        key = (lay.world, lay.tp, lay.pp, lay.vp, lay.cp)
        return key + (lay.ep, lay.etp) if self.cfg.model.num_moe_experts else key


def resolve_tokenizer(cfg: Config) -> TokenizerPlan | None:
    """Decide the run's tokenizer (the one owner of that decision); None when its files cannot be read (validation
    reports why)."""
    from pretrain.data.check import run_tokenizer_identity, uses_null_tokenizer

    RESOLUTIONS["tokenizer"] += 1
    null = uses_null_tokenizer(cfg.data)
    try:
        identity = run_tokenizer_identity(cfg, null)
    except Exception as exc:  # noqa: BLE001 - unusable tokenizer settings or files: validation reports why, in one line
        return TokenizerPlan(null=null, identity=None, error=str(exc))
    why = "the null tokenizer of mock data needs model.vocab_size" if identity is None else None
    return TokenizerPlan(null=null, identity=identity, error=why)


def _data_plan(cfg: Config) -> DataPlan:
    from pretrain.data.cache import data_cache_dir  # (pretrain.data.datasets imports torch)
    from pretrain.data.check import used_blends, uses_mock

    blends = used_blends(cfg, Report(0))  # problems in them are validation's to report
    return DataPlan(mock=uses_mock(cfg.data), blends=blends, split=cfg.data.split, cache_dir=data_cache_dir(cfg))


def resolve(cfg: Config, world_size: int, *, data_files: bool = True, **validate_kwargs) -> RunPlan:
    """Resolve `cfg` for `world_size` ranks once: the tokenizer, then validation (which derives the layout with the
    tokenizer's vocabulary), then the data plan. Never raises for config problems: they are in `plan.problems`."""
    from pretrain.validate import check

    tokenizer = resolve_tokenizer(cfg)
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    problems, layout = check(cfg, world_size, vocab_size=vocab, tokenizer=tokenizer, data_files=data_files,
                             **validate_kwargs)
    return RunPlan(cfg=cfg, world_size=world_size, layout=layout, tokenizer=tokenizer, data=_data_plan(cfg),
                   problems=problems, model=model_plan(cfg))


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
    tokenizer = resolve_tokenizer(cfg)
    layout = derive_layout(cfg, world_size, vocab_size=tokenizer.vocab_size if tokenizer else None,
                           on_gpu=on_gpu, te=False)
    return RunPlan(cfg=cfg, world_size=world_size, layout=layout, tokenizer=tokenizer,
                   data=_data_plan(cfg), problems=Report(world_size), model=model_plan(cfg))
