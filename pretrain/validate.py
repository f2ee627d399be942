"""Pre-flight validation: every layout and config rule, checked before any process group exists.

All violations are reported at once, each naming the keys involved and a fix (`pretrain/problems.py`). The
rules live in `pretrain/rules/` by concern: `parallel` (layout, MoE), `mla` (MLA, DeepSeek routing, MTP), `model`
(precision, shapes), `run` (optimizer, run, checkpoint, data), `operations` (documents, recompute, FSDP,
logging), `context` (CP), `windows` (sliding-window attention), `linear_attention` (Gated DeltaNet layers, gated
attention), `hybrid` (hybrid Mamba models), `bounds` (first: every numeric key against the range its declaration
gives, `knob(range=...)`; and the run's sample count),
and last `megatron` (Megatron-Core's own TransformerConfig / OptimizerConfig / GPTDatasetConfig checks). A rule takes
the config sections it reads, by name (`def window_rules(r, *, model, parallel, lay, te_on_gpu)`: `run_rule` passes
them). The trainer runs the same checks first; `python -m pretrain validate CONFIG [overrides] --world-size N` runs them
alone (exit 2 on errors).
"""

from __future__ import annotations

import inspect
from functools import partial

from pretrain.config import Config
from pretrain.layout import Layout, LayoutError, derive_layout, te_available
from pretrain.problems import Problem, Report, ValidationFailed
from pretrain.rules.bounds import bounds_rules, range_rules
from pretrain.rules.context import context_rules
from pretrain.rules.hybrid import hybrid_rules
from pretrain.rules.linear_attention import linear_attention_rules
from pretrain.rules.megatron import megatron_config_rules, megatron_data_rules
from pretrain.rules.mla import blockwise_fp8_rules, deepseek_moe_rules, mla_rules, mtp_rules
from pretrain.rules.model import length_problems, model_rules, precision_rules
from pretrain.rules.operations import document_rules, fsdp_rules, logging_rules, recompute_module_rules
from pretrain.rules.optimizer import muon_rules
from pretrain.rules.parallel import layout_rules, moe_rules, sizes_positive
from pretrain.rules.performance import performance_rules
from pretrain.rules.placement import placement_note
from pretrain.rules.resilience import resilience_rules
from pretrain.rules.run import data_config_rules, data_rules, optimizer_rules, run_rules
from pretrain.rules.sinks import glu_bias_yarn_rules, sink_rules
from pretrain.rules.windows import window_rules

__all__ = ["Problem", "Report", "ValidationFailed", "check", "length_problems", "validate"]


def validate(cfg: Config, world_size: int, **kwargs) -> Report:
    """Check `cfg` for a job of `world_size` processes (`check`'s report). Never raises for config problems."""
    return check(cfg, world_size, **kwargs)[0]


def check(cfg: Config, world_size: int, *, tokenizer=None, data=None, model=None,
          **kwargs) -> tuple[Report, Layout | None]:
    """`check_planned` for a caller without a run plan (the planner, the HF import, tools): the data plan, the
    model plan and (with `files`) the tokenizer decided here, as `pretrain.run_plan.resolve` decides them."""
    from model_providers.core.model_plan import model_plan
    from pretrain.data.plan import data_plan
    from pretrain.tokenizer.choice import decide

    data, model = data or data_plan(cfg), model or model_plan(cfg)
    if tokenizer is None and kwargs.get("files", True):
        tokenizer = decide(cfg.data, cfg.model.vocab_size, data.mock, cfg.model.preset)
    return check_planned(cfg, world_size, tokenizer=tokenizer, data=data, model=model, **kwargs)


def check_planned(cfg: Config, world_size: int, *, te_on_gpu: bool | None = None, cuda_available: bool | None = None,
                  files: bool = True, versions=None, data_files: bool = True, gpu_dry_run: bool = False,
                  vocab_size: int | None = None, tokenizer=None, data=None,
                  model=None) -> tuple[Report, Layout | None]:
    """Check `cfg` for a job of `world_size` processes: (the problems, the layout derived on the way, None when the
    sizes hold none). Never raises for config problems. `vocab_size`, `tokenizer`, `data`, `model`: the tokenizer's
    vocabulary, its `TokenizerPlan`, the `DataPlan` and the `ModelPlan`, resolved once by `pretrain.run_plan` (the
    rules decide, parse and load none of them again; `check` makes them for a caller without a run plan).

    Single-field choices (enums, families) were checked when the config was parsed; these are the rules
    that combine fields, the world size and this machine. `files=False` checks the config alone: the data
    section (blends, tokenizer, dataset files) and `checkpoint.pretrained` are skipped (the planner sizes
    layouts of configs whose data lives elsewhere).

    `versions` (a `pretrain.compat.matrix.Installed`): the installation to check; None: this interpreter's.
    `data_files=False`: the data rules that open no dataset file (the trainer checks the files on one rank and
    shares the verdict: `pretrain.data.datasets.check_data_files_once`).
    `gpu_dry_run` (`validate --world-size N`): on a machine without CUDA, check the job as it runs on GPUs with
    Transformer Engine; what only this machine could not run becomes notes.
    """
    if cuda_available is None:
        from pretrain.compat.cuda import cuda_available as cuda_here

        cuda_available = cuda_here()
    if gpu_dry_run and not cuda_available:
        return _gpu_dry_run(cfg, world_size, files=files, versions=versions, data_files=data_files,
                            vocab_size=vocab_size, tokenizer=tokenizer, data=data, model=model), None
    if te_on_gpu is None:
        te_on_gpu = te_available() if cuda_available else False
    r = Report(world_size)
    out_of_range = range_rules(r, cfg)  # every numeric key against its declared range, first
    lay, rules = None, [precision_rules, optimizer_rules, muon_rules, run_rules, logging_rules, performance_rules,
                        resilience_rules]
    if sizes_positive(r, world_size, out_of_range):  # else only the rules that do no arithmetic on the sizes
        try:
            lay = derive_layout(cfg, world_size, vocab_size=vocab_size, on_gpu=cuda_available, te=te_on_gpu)
        except LayoutError:
            pass
        rules = [layout_rules, moe_rules, deepseek_moe_rules, mla_rules, mtp_rules, blockwise_fp8_rules, model_rules,
                 *rules, document_rules, recompute_module_rules, fsdp_rules, context_rules, window_rules,
                 sink_rules, glu_bias_yarn_rules, linear_attention_rules, hybrid_rules, bounds_rules]
    if files:
        rules.append(partial(data_rules if data_files else data_config_rules, tokenizer=tokenizer, data_plan=data))
    for rule in rules:
        run_rule(rule, r, cfg, lay, te_on_gpu)
    # Last: Megatron-Core's own TransformerConfig / OptimizerConfig checks, where no rule above found an error.
    megatron_config_rules(r, cfg, lay, te_on_gpu, model=model, data=data)
    placement_note(r, cfg.model, lay)
    if files:  # and GPTDatasetConfig's
        megatron_data_rules(r, cfg, lay, te_on_gpu, data=data)
    # Installed Python / megatron-core / Transformer Engine / torch against the supported matrix.
    from pretrain.compat import matrix

    matrix.check(r, versions, allow_untested=cfg.run.allow_untested_versions)
    return r, lay


def run_rule(rule, r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Call `rule(r, ...)` with what its keyword-only parameters name (those without a default): config sections by
    their name (`model`, `parallel`, ...), `lay` (the derived layout or None) and `te_on_gpu`. A rule's signature
    is the list of what it reads."""
    given = {"lay": lay, "te_on_gpu": te_on_gpu}
    wanted = [p.name for p in inspect.signature(rule).parameters.values()
              if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    rule(r, **{name: given[name] if name in given else getattr(cfg, name) for name in wanted})


def _gpu_dry_run(cfg: Config, world_size: int, **kwargs) -> Report:
    """The job checked as on GPUs with Transformer Engine (a login node validating a cluster job); the problems
    this machine alone has (no CUDA, no TE: the local spec, gloo) are notes, not errors."""
    report = check_planned(cfg, world_size, te_on_gpu=True, cuda_available=True, **kwargs)[0]
    here = check_planned(cfg, world_size, te_on_gpu=False, cuda_available=False, files=False,
                         versions=kwargs["versions"], data=kwargs["data"], model=kwargs["model"])[0]
    on_gpus = {str(p) for p in report.errors}
    report.megatron_verdicts += here.megatron_verdicts  # stored with the report's own
    report.notes.extend(f"this machine's layout: {n}" for n in here.notes if n.startswith("Megatron-Core's own checks"))
    report.notes.insert(0, "checked as on GPUs with Transformer Engine (--world-size on a machine without CUDA: a GPU "
                           "dry run)")
    report.notes.extend(f"not on this machine (no CUDA, no Transformer Engine): {p}" for p in here.errors
                        if str(p) not in on_gpus)
    return report


def store_verdicts(r: Report, cache_dir: str, create: bool = True) -> int:
    """Once validation passed (`r`): the data check's full reads (`pretrain.data.check.store_verdicts`), Megatron-Core's
    checks that passed (`pretrain.rules.megatron_verdicts`) and the accepted start (`pretrain.rules.start`) into their
    caches in the data cache dir `cache_dir` (the run plan's; `create=False`: only into one that exists, as `validate`
    does). Returns how many dataset verdicts were written."""
    from pretrain.data.check import store_verdicts as store_data_verdicts
    from pretrain.rules import megatron_verdicts, start

    if r.errors:
        return 0
    megatron_verdicts.store(cache_dir, r.megatron_verdicts, create=create)
    megatron_verdicts.store(cache_dir, r.start_verdicts, create=create, directory=start.VERDICT_DIR)
    return store_data_verdicts(cache_dir, r, create=create)
