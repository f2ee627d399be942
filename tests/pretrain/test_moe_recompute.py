"""Selective recompute on an MoE model (`model.recompute_modules: [moe]`, tiny_moe, CPU local spec): the same
losses, and fewer bytes held for backward by the planner's amount.

`moe` checkpoints each whole MoE layer (router, all-to-all dispatch, experts); `moe_act` needs grouped-GEMM experts
(GPU, Transformer Engine) and is covered by the validator here. Same method as tests/pretrain/test_recompute.py.
"""

from __future__ import annotations

import pytest

from tests.pretrain.ckpt_helpers import metrics
from tests.pretrain.recompute_helpers import check_saving, planned_layer_saving, train_and_measure

pytestmark = pytest.mark.slow

SELECTIVE = {
    "moe": ["model.recompute_granularity=selective", "model.recompute_modules=[moe]"],
    "all": ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,moe,layernorm]"],
}
CASES = {"none": [], **SELECTIVE}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_recompute")
    return tmp, train_and_measure(tmp, "tiny_moe", CASES)


@pytest.mark.parametrize("name", list(SELECTIVE))
def test_same_losses_as_without_recompute(measured, name):
    tmp, held = measured
    # Losses, grad norms and the MoE metrics (auxiliary losses, tokens per expert): the recomputed router's second
    # forward must not count twice.
    def fields(m: dict) -> dict:
        return {k: v for k, v in m.items() if k in ("step", "loss", "grad_norm") or k.startswith("moe_")}

    want = [fields(m) for m in metrics(tmp / "none")]
    got = [fields(m) for m in metrics(tmp / name)]
    print(f"{name}: losses {[m['loss'] for m in got]}; MoE keys {sorted(k for k in got[0] if k.startswith('moe_'))}")
    assert len(want) == 3 and any(k.startswith("moe_") for k in want[0])
    # The grad norm's float sum may be ordered differently (as in test_recompute); everything else identical.
    assert [{k: v for k, v in m.items() if k != "grad_norm"} for m in got] == \
        [{k: v for k, v in m.items() if k != "grad_norm"} for m in want]
    assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in want], rel=1e-6)
    assert held[name]["loss"] == held["none"]["loss"]
    assert held[name]["grad_norm"] == pytest.approx(held["none"]["grad_norm"], rel=1e-7)


@pytest.mark.parametrize("name", list(SELECTIVE))
def test_fewer_bytes_held_by_the_planned_amount(measured, name):
    _, held = measured
    check_saving(name, held, 4 * planned_layer_saving("tiny_moe", SELECTIVE[name]))  # tiny_moe: 4 layers
