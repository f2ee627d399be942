"""A config field declares its facts once (`knob(...)`, model_providers/core/knobs.py): the Megatron-Core attribute it
feeds, its resume rule, its range. The declarations against Megatron-Core's own classes, the ranges through the CLI
(issue 39 item 4: every example refused by `validate`, one line per key, all at once), and the first step's
non-finite result blamed on the config, not the learning rate.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing

import pytest

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import SMALL, log_text

# Issue 39, item 4 and the minor note on infinite values: each key, as the user writes it.
EXAMPLES = ["model.attention_dropout=1.5", "model.hidden_dropout=-0.5", "model.layernorm_epsilon=-1",
            "model.rotary_percent=1.5", "optimizer.muon.num_ns_steps=100000000",
            "optimizer.muon.extra_scale_factor=inf", "hang.floor_s=inf", "optimizer.adam_beta2=1",
            "optimizer.lr=nan", "model.init_method_std=0"]


def _numeric_leaves():
    from model_providers.core.knobs import knob_of, leaves, number_types
    from pretrain.config import Config

    for key, section, f in leaves(Config):
        numbers = number_types(typing.get_type_hints(section)[f.name])
        if numbers:
            yield key, knob_of(f), numbers


def test_every_numeric_key_declares_its_range():
    """Every int and float key of every section says which values mean something (floats at least "finite")."""
    missing = [key for key, decl, _ in _numeric_leaves() if decl.range is None]
    assert not missing, f"numeric config keys without knob(range=...): {missing}"
    assert len(list(_numeric_leaves())) > 100


def test_shipped_configs_and_presets_are_in_range():
    """The declared ranges accept every shipped config and every preset (and the defaults)."""
    from model_providers import all_presets
    from pretrain.config import CONFIG_DIR, load_config
    from pretrain.problems import Report
    from pretrain.rules.bounds import range_rules

    configs = [(f.stem, []) for f in sorted(CONFIG_DIR.glob("*.yaml"))]
    configs += [(None, [f"model.preset={name}"]) for name in sorted(all_presets())]
    from pretrain.stages.spec import derive

    for path, overrides in [(None, []), *configs]:
        # A config in stages is checked as validate checks it: each stage's config (the base's train.steps is the
        # stages' sum, derived there).
        for stage in derive(load_config(path, overrides)).stages:
            r = Report(1)
            assert range_rules(r, stage.cfg) == set(), (path, overrides, stage.name, r.text())


@pytest.mark.mcore
def test_declared_attributes_exist_in_megatron_core():
    """Every `mcore=` names an attribute Megatron-Core's class has (its dataclass fields, GPTModel's, MambaModel's and
    the Mamba mixer's arguments);
    YaRN's are attributes Megatron-Core reads off the built config; Muon's go through the release's renames."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.mamba import MambaModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from model_providers.core.knobs import knob_of, leaves
    from model_providers.core.mamba_builder import release_name
    from pretrain.compat.muon import muon_fields
    from pretrain.config import Config

    names = {c.__name__: {f.name for f in dataclasses.fields(c)} for c in
             (TransformerConfig, MLATransformerConfig, OptimizerConfig, DistributedDataParallelConfig,
              GPTDatasetConfig)}
    names["GPTModel"] = set(inspect.signature(GPTModel.__init__).parameters)
    names["MambaMixer"] = set(inspect.signature(MambaMixer.__init__).parameters)
    try:  # 0.19+: MambaModel is HybridModel's deprecated wrapper (*args, **kwargs)
        from megatron.core.models.hybrid.hybrid_model import HybridModel as hybrid_model
    except ImportError:
        hybrid_model = MambaModel
    names["MambaModel"] = set(inspect.signature(hybrid_model.__init__).parameters)
    fed = 0
    for key, _, f in leaves(Config):
        for feed in knob_of(f).mcore:
            attr = feed.attr or f.name
            if feed.when == "yarn":
                assert attr.startswith("yarn_"), key
                continue
            if feed.config == "OptimizerConfig" and attr.startswith("muon_"):
                attr = next(iter(muon_fields({attr: 0})), None)
                if attr is None:  # a field this release does not have (validation keeps the default)
                    continue
            if feed.config == "MambaModel":  # the release's name of the argument
                attr = release_name(attr)
            assert attr in names[feed.config], f"{key}: {feed.config} has no {attr}"
            fed += 1
    assert fed > 80


@pytest.mark.mcore
def test_a_new_knob_is_one_declaration():
    """A model field declared `mcore=TC.named(...)` reaches TransformerConfig with no other edit: the builder passes
    every declared field (here one Megatron-Core has and the model section does not: its default is True)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from model_providers.core.builder import transformer_config
    from model_providers.core.knobs import TC, knob
    from pretrain.config import ModelConfig, load_config
    from pretrain.run_plan import for_weights

    assert {f.name: f.default for f in dataclasses.fields(TransformerConfig)}["attention_softmax_in_fp32"] is True

    @dataclasses.dataclass
    class Extended(ModelConfig):
        softmax_fp32: bool = knob(False, mcore=TC.named("attention_softmax_in_fp32"))

    cfg = load_config("tiny_llama", ["data.mock=true"])
    cfg.model = Extended(**dataclasses.asdict(cfg.model))
    plan = for_weights(cfg, 1)
    assert transformer_config(plan.model, plan.layout).attention_softmax_in_fp32 is False


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """The CLI's entry point on one pool rank: validate with the issue's examples; two 1-step trainings whose first
    step is not finite (a NaN loss injected at step 1; a config whose gradients overflow)."""
    root = tmp_path_factory.mktemp("knobs")
    train = ["train", "tiny_llama", *SMALL, "data.mock=true", "train.steps=2", "model.num_layers=1"]
    cases = [
        {"name": "examples", "argv": ["validate", "tiny_llama", "data.mock=true", *EXAMPLES]},
        {"name": "rotary_zero", "argv": ["validate", "tiny_llama", "data.mock=true", "model.rotary_percent=0"]},
        {"name": "nan_loss", "argv": [*train, "testing.nan_step=1", "testing.nan_times=always",
                                      f"run.dir={root}/nan_loss"]},
        {"name": "nan_grad", "argv": [*train, "model.init_method_std=1e30", f"run.dir={root}/nan_grad"]},
    ]
    plan = root / "plan.json"
    plan.write_text(json.dumps({"results": str(root / "results.json"), "cases": cases}))
    log = root / "worker.log"
    rc = run_case(1, "tests.pretrain.cli_failures_worker", [str(plan)], log, timeout=600,
                  env={"PRETRAIN_TESTING": "1"})
    assert rc == 0, log_text(log)[-4000:]
    return json.loads((root / "results.json").read_text())


@pytest.mark.slow
def test_out_of_range_values_refused_at_validate_all_at_once(cli):
    res = cli["examples"]
    assert res["rc"] == 2 and res["escaped"] is None and "Traceback" not in res["stderr"], res
    lines = [ln for ln in res["stderr"].splitlines() if ln.lstrip()[:1].isdigit()]
    assert len(lines) == len(EXAMPLES), res["stderr"]
    for example in EXAMPLES:  # one line per key, naming it and the value given
        key, value = example.split("=")
        mine = [ln for ln in lines if f"] {key}=" in ln]
        assert len(mine) == 1, (example, res["stderr"])
        assert float(mine[0].split(f"] {key}=", 1)[1].split(" ", 1)[0]) == pytest.approx(float(value), nan_ok=True)
    # The rule each states: a probability in [0, 1), a finite positive number (inf refused with those words), ...
    text = res["stderr"]
    assert "model.attention_dropout=1.5 must be in [0, 1)" in text
    assert "model.rotary_percent=1.5 must be in (0, 1]" in text
    assert "optimizer.muon.extra_scale_factor=inf must be a finite number above 0" in text
    assert "hang.floor_s=inf must be a finite number above 0" in text
    assert "optimizer.lr=nan must be a finite number, 0 or more" in text
    assert "optimizer.muon.num_ns_steps=100000000 must be in [1, 100]" in text
    rot = cli["rotary_zero"]
    assert rot["rc"] == 2 and "model.rotary_percent=0.0 must be in (0, 1]" in rot["stderr"], rot


@pytest.mark.slow
def test_first_step_not_finite_blames_the_config(cli):
    """Step 1's result comes before any optimizer update: the message says the config is the likely cause and names
    the model settings set away from the preset, not "lower optimizer.lr"."""
    for name, what in (("nan_loss", "step 1: loss nan;"), ("nan_grad", "step 1: gradient norm nan;")):
        res = cli[name]
        errors = [ln for ln in res["stderr"].splitlines() if ln.startswith("[pretrain] error: ")]
        assert res["rc"] == 3 and len(errors) == 1 and res["escaped"] is None, res
        assert errors[0].startswith(f"[pretrain] error: {what}"), errors
        assert "optimizer.lr is not the cause" in errors[0] and "lower optimizer.lr" not in errors[0], errors
    assert "model.init_method_std=1e+30" in cli["nan_grad"]["stderr"]
