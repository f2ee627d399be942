"""Selective recompute of DeepSeek-V3-class modules (`model.recompute_modules: [mla_up_proj, shared_experts, mlp]`,
tiny_deepseek: MLA, shared experts, a dense first layer, an MTP layer; CPU local spec): the same loss and gradients
as without recompute, and fewer bytes held for backward by the planner's amount. Megatron-Bridge's DeepSeek-V3
recipes recompute these (benchmarks/published_runs.yaml). Method of tests/pretrain/test_moe_recompute.py, one forward
and backward per case (`tests/pretrain/recompute_worker.py`)."""

from __future__ import annotations

import json

import pytest

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import log_text
from tests.pretrain.recompute_helpers import SHAPE, check_saving

pytestmark = [pytest.mark.slow, pytest.mark.mcore]

MODULES = ["model.recompute_granularity=selective", "model.recompute_modules=[mla_up_proj,shared_experts,mlp]"]


def _planned_saving() -> int:
    """The planner's bytes per microbatch over the decoder and MTP layers, without recompute minus with the modules."""
    from pretrain.config import load_config
    from pretrain.layout import derive_layout
    from pretrain.planner.activations import recomputed_modules, stage_layers

    cfg = load_config("tiny_deepseek", SHAPE + MODULES)
    lay = derive_layout(cfg, 1, vocab_size=4096, on_gpu=False, te=False)
    return sum(stage_layers(cfg, lay, 0, 0)) - sum(stage_layers(cfg, lay, 0, 0, recomputed_modules(cfg.model)))


def test_same_gradients_and_the_planned_saving(tmp_path):
    cases = [{"name": n, "config": "tiny_deepseek",
              "overrides": SHAPE + ["train.global_batch_size=2", f"run.dir={tmp_path / 'held'}", *extra]}
             for n, extra in (("none", []), ("mla", MODULES))]
    (tmp_path / "held.json").write_text(json.dumps(cases))
    rc = run_case(1, "tests.pretrain.recompute_worker", [str(tmp_path / "held.json"), str(tmp_path / "out.json")],
                  tmp_path / "held.log", timeout=600)
    assert rc == 0, log_text(tmp_path / "held.log")[-3000:]
    held = json.loads((tmp_path / "out.json").read_text())
    assert held["mla"]["loss"] == held["none"]["loss"]
    assert held["mla"]["grad_norm"] == pytest.approx(held["none"]["grad_norm"], rel=1e-7)
    check_saving("mla", held, _planned_saving())
