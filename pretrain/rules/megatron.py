"""Megatron-Core's own checks, run in validation: the run's `TransformerConfig` and `OptimizerConfig` are built
exactly as the trainer builds them, and whatever their `__post_init__` asserts or raises becomes one problem line.

The rules in this package name the keys and the fix for everything they know; this one catches what they do not
(a new release's assert, a combination nobody wrote a rule for), so that `validate` never accepts a config the
trainer's first Megatron-Core call then refuses with a bare `AssertionError`. It runs only when no other rule
found an error (a knock-on of an error already reported would only repeat it).

A process that has not imported megatron-core yet (the `validate` CLI) first looks for the verdict of the same
checks on the same input in the cache dir (`pretrain.rules.megatron_verdicts`); found, they are not run again and
one note says so. Checks that pass are recorded in `Report.megatron_verdicts`, stored once validation passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pretrain.config import Config, ModelConfig
    from pretrain.layout import Layout
    from pretrain.problems import Report

# What Megatron-Core's config classes raise for a combination they refuse.
_REFUSALS = (AssertionError, ValueError, TypeError, NotImplementedError, RuntimeError, KeyError)


def _why(exc: BaseException, m: ModelConfig) -> str:
    """The refusal in one line: its message (Megatron-LM's `--flag-names` that are `model.*` keys here named as
    such), else the assert's source line."""
    import re
    import traceback

    lines = str(exc).strip().splitlines()
    if lines:
        text = " ".join(x.strip() for x in lines)[:400].rstrip(".")

        def key(match: re.Match) -> str:
            name = match.group(1).replace("-", "_")
            return f"{match.group(0)} (model.{name})" if hasattr(m, name) else match.group(0)

        return re.sub(r"--([a-z0-9][a-z0-9-]*)", key, text)
    frames = traceback.extract_tb(exc.__traceback__)
    where = frames[-1] if frames else None
    if where is None:
        return type(exc).__name__
    return f"{type(exc).__name__} `{(where.line or '').strip()}` ({where.name}, line {where.lineno})"


def _words(exc: BaseException, m: ModelConfig) -> str:
    """Megatron-Core's own words, after our reason: `(Megatron-Core: "...")`."""
    return f'(Megatron-Core: "{_why(exc, m)}")'


def _this_machine(lay: Layout) -> bool:
    """The layout is for this machine (a GPU or Transformer Engine layout checked elsewhere, e.g. by the planner
    on a login node, is left to the rules: Megatron-Core's checks would test this machine's libraries)."""
    import importlib.util

    from pretrain.compat.cuda import cuda_available

    if lay.on_gpu != cuda_available():
        return False
    return not lay.use_te or importlib.util.find_spec("transformer_engine") is not None


_NAMES = {"config": "TransformerConfig, OptimizerConfig", "data": "GPTDatasetConfig"}
_CACHED = "Megatron-Core's own checks ("


def _cached(r: Report, kind: str, cfg: Config, lay: Layout | None, te_on_gpu: bool,
            cache_dir: str) -> tuple[str, dict] | bool:
    """True (and one note) when the verdict cache in `cache_dir` holds `kind`'s checks of this exact input (the
    whole config tree, the layout, this installation) as passed; else the (key, facts) to record if they pass now."""
    from pretrain.compat.cuda import cuda_available
    from pretrain.rules import megatron_verdicts

    key, facts = megatron_verdicts.verdict_key([kind], cfg, lay, r.world_size, cuda_available(), te_on_gpu)
    found = megatron_verdicts.usable() and megatron_verdicts.lookup(cache_dir, key, facts)
    if not found:
        return key, facts
    names = _NAMES[kind]
    earlier = [i for i, n in enumerate(r.notes) if n.startswith(_CACHED)]
    if earlier:  # one line for every check the cache answered
        names = r.notes.pop(earlier[0])[len(_CACHED):].split(")")[0] + ", " + names
    r.notes.append(f"{_CACHED}{names}) passed for this exact config, layout, installation and code before: verdict "
                   f"from the cache {found.parent} (not re-run, megatron-core not imported)")
    return True


def megatron_config_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool, model=None,
                          data=None) -> None:
    """Build the run's `TransformerConfig` (from `model`, the run plan's `ModelPlan`) and `OptimizerConfig`; a
    refusal is one problem naming it. `data`: the run plan's `DataPlan` (its cache dir holds the verdicts)."""
    if lay is None or r.errors or not _this_machine(lay):
        return
    cached = _cached(r, "config", cfg, lay, te_on_gpu, data.cache_dir)
    if cached is True:
        return
    import warnings

    from pretrain import compat

    compat.import_megatron(lay.on_gpu)  # imported as the trainer imports it; nothing patched (torch stays as it is)
    from model_providers.core.builder import transformer_config
    from model_providers.core.optional_modules import missing_dependency

    missing = missing_dependency(model)
    if missing:
        r.error("model", missing, "install it in this environment (the cluster's too)")
        return
    try:
        with warnings.catch_warnings():  # its notes (defaults it fills in) are the trainer's to print
            warnings.simplefilter("ignore")
            transformer_config(model, lay)
    except _REFUSALS as exc:
        r.error("model", f"Megatron-Core's TransformerConfig refuses this model and layout {_words(exc, cfg.model)}",
                "change the model.* / parallel.* keys it names (validate cannot name them more precisely)")
    from model_providers.core.optimizer_config import optimizer_config

    try:
        optimizer_config(cfg.optimizer, lay)
    except _REFUSALS as exc:
        r.error("optimizer", "Megatron-Core's OptimizerConfig refuses these optimizer settings "
                f"{_words(exc, cfg.model)}", "change the optimizer.* keys it names")
    if not r.errors:
        r.megatron_verdicts.append(cached)


def megatron_data_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool, data=None) -> None:
    """Build the run's `GPTDatasetConfig` (`pretrain.data.datasets.megatron_dataset_config` of `data`, the run plan's
    `DataPlan`, with a stand-in tokenizer: the config checks only that there is one); a refusal is one problem
    naming it. Where no other rule found an error."""
    if r.errors:
        return
    cached = _cached(r, "data", cfg, lay, te_on_gpu, data.cache_dir)
    if cached is True:
        return
    from types import SimpleNamespace

    from pretrain.data.datasets import megatron_dataset_config

    try:
        megatron_dataset_config(data, SimpleNamespace(vocab_size=None), num_eval_samples=1)
    except _REFUSALS as exc:
        r.error("data", f"Megatron-Core's GPTDatasetConfig refuses these data settings {_words(exc, cfg.model)}",
                "change the data.* keys it names")
        return
    r.megatron_verdicts.append(cached)
