"""Selective recompute on an MoE model (`model.recompute_modules: [moe]`, tiny_moe, CPU local spec): the same
losses, and fewer bytes held for backward by the planner's amount.

`moe` checkpoints each whole MoE layer (router, all-to-all dispatch, experts); `moe_act` needs grouped-GEMM experts
(GPU, Transformer Engine) and is covered by the validator here. Same method as tests/pretrain/test_recompute.py.
"""

from __future__ import annotations

import json

import pytest

from tests.pretrain.ckpt_helpers import SMALL, command, log_text, metrics, run

pytestmark = pytest.mark.slow

SELECTIVE = {
    "moe": ["model.recompute_granularity=selective", "model.recompute_modules=[moe]"],
    "all": ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,moe,layernorm]"],
}
CASES = {"none": [], **SELECTIVE}
SHAPE = ["data.mock=true", "model.vocab_size=4096", "model.seq_length=128", "train.micro_batch_size=2"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_recompute")
    trainer = [{"config": "tiny_moe", "overrides": SMALL + ["train.steps=3", "checkpoint.interval=null",
                                                           "checkpoint.save_at_end=false", f"run.dir={tmp / n}",
                                                           *extra]} for n, extra in CASES.items()]
    held = [{"name": n, "config": "tiny_moe",
             "overrides": SHAPE + ["train.global_batch_size=2", f"run.dir={tmp / 'held'}", *extra]}
            for n, extra in CASES.items()]
    (tmp / "trainer.json").write_text(json.dumps(trainer))
    (tmp / "held.json").write_text(json.dumps(held))
    rc = run(command([], module="tests.pretrain.layout_worker", args=[str(tmp / "trainer.json")]), tmp / "train.log",
             timeout=600)
    assert rc == 0, log_text(tmp / "train.log")[-3000:]
    rc = run(command([], module="tests.pretrain.recompute_worker", args=[str(tmp / "held.json"),
                                                                          str(tmp / "held_out.json")]),
             tmp / "held.log", timeout=600)
    assert rc == 0, log_text(tmp / "held.log")[-3000:]
    return tmp, json.loads((tmp / "held_out.json").read_text())


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
    assert got == want
    assert held[name]["loss"] == held["none"]["loss"]
    assert held[name]["grad_norm"] == pytest.approx(held["none"]["grad_norm"], rel=1e-7)


def planned_layer_saving(overrides: list[str]) -> int:
    """The planner's bytes per decoder layer and microbatch without recompute minus with this config's modules."""
    from pretrain.config import load_config
    from pretrain.layout import derive_layout
    from pretrain.planner.activations import layer_activation_bytes, recomputed_modules

    cfg = load_config("tiny_moe", SHAPE + overrides)
    lay = derive_layout(cfg, 1, vocab_size=4096, on_gpu=False, te=False)
    return layer_activation_bytes(cfg, lay) - layer_activation_bytes(cfg, lay, modules=recomputed_modules(cfg))


@pytest.mark.parametrize("name", list(SELECTIVE))
def test_fewer_bytes_held_by_the_planned_amount(measured, name):
    _, held = measured
    saved = held["none"]["held_bytes"] - held[name]["held_bytes"]
    planned = 4 * planned_layer_saving(SELECTIVE[name])  # tiny_moe: 4 layers
    print(f"{name}: held {held[name]['held_bytes']:,} B vs {held['none']['held_bytes']:,} B without recompute: "
          f"saves {saved:,} B; planner {planned:,} B ({(saved - planned) / planned:+.2%})")
    assert saved > 0
    assert abs(saved - planned) <= 0.01 * planned
