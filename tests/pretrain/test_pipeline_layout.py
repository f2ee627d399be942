"""Flexible pipeline placement on CPU: `parallel.pipeline_layout` (Megatron-Core's pipeline_model_parallel_layout)
and `parallel.account_for_{embedding,loss}_in_pipeline_split` train to the one-rank losses and grad norms (fp32,
4 steps, ≤ 1e-6 relative), and a checkpoint saved at one placement loads at another.

Tier 1: tiny_llama (6 layers) at PP2 × VP2 with the uneven layout `Ett|t|tt|tL`, saving at step 2; tiny_deepseek
with a last stage holding only the MTP layer and the loss (`Etttt|mL`).
Tier 2: that checkpoint loaded at the even PP2 split (and both runs' step-4 checkpoints exported to HF agree);
tiny_llama at PP4 `Et|ttt|t|tL`; tiny_llama at PP2 × VP2 with the embedding and loss counted in the split;
tiny_deepseek with its MTP layer placed by the layout (`Et|t|t|tmL`); every other kind of stage a layout string
places (`tests/pretrain/combinations.py` PLACEMENTS: the embedding alone, the loss alone, both on one stage, empty
stages, the MTP layer and the loss alone at VP2).
"""

from __future__ import annotations

import json

import pytest

from tests import tiers
from tests.pool import run_case
from tests.pool.reference import reference_run
from tests.pretrain.ckpt_helpers import SMALL, by_step, log_text
from tests.pretrain.combinations import PLACEMENTS, placement_world

pytestmark = [pytest.mark.slow, pytest.mark.mcore]

STEPS = 4
TOLERANCE = 1e-6
BASE = [*SMALL, f"train.steps={STEPS}", "checkpoint.save_at_end=false"]
NO_CKPT = ["checkpoint.interval=null"]
LLAMA6 = ["model.num_layers=6", "model.vocab_size=32000"]  # the embedded tokenizer's: the HF export writes it

# name: (world, config, overrides, checkpoint source or None)
CASES = {
    "llama_pp2_vp2_layout": (2, "tiny_llama", [*LLAMA6, "parallel.pipeline=2", "parallel.virtual_pipeline=2",
                                               "parallel.pipeline_layout=Ett|t|tt|tL", "checkpoint.interval=2"], None),
    "llama_layout_to_even": (2, "tiny_llama", [*LLAMA6, *NO_CKPT, "parallel.pipeline=2", "checkpoint.save_at_end=true"],
                             "llama_pp2_vp2_layout"),
    "llama_split_vp2": (2, "tiny_llama", [*LLAMA6, *NO_CKPT, "parallel.pipeline=2", "parallel.virtual_pipeline=2",
                                          "parallel.account_for_embedding_in_pipeline_split=true",
                                          "parallel.account_for_loss_in_pipeline_split=true"], None),
    "deepseek_mtp_layout": (2, "tiny_deepseek", [*NO_CKPT, "parallel.pipeline=2", "parallel.virtual_pipeline=2",
                                                 "parallel.pipeline_layout=Et|t|t|tmL"], None),
    "llama_pp4_layout": (4, "tiny_llama", [*LLAMA6, *NO_CKPT, "parallel.pipeline=4",
                                           "parallel.pipeline_layout=Et|ttt|t|tL"], None),
    **{name: (placement_world(extra), config, [*NO_CKPT, *extra], None)
       for name, (config, extra) in PLACEMENTS.items()},
}
FULL = {"llama_layout_to_even", "llama_split_vp2", "deepseek_mtp_layout", "llama_pp4_layout"} | \
    (set(PLACEMENTS) - {"mtp_alone"})


def _reference(config: str, overrides: list[str]):
    """The one-rank run of `config` with the case's model overrides."""
    return reference_run(config, [*BASE, *NO_CKPT, *(o for o in overrides if o.startswith("model."))])


@pytest.fixture(scope="module")
def placement_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    cases = tiers.pick(CASES, FULL)
    for world in sorted({w for w, *_ in cases.values()}):
        plan_cases = []
        for name, (w, config, overrides, source) in cases.items():
            if w != world:
                continue
            case = {"name": name, "config": config, "overrides": [*BASE, *overrides, f"run.dir={root}/{name}"]}
            if source is not None:
                case["copy_from"] = [f"{root}/{source}", 2]
            plan_cases.append(case)
        plan = root / f"world{world}.json"
        plan.write_text(json.dumps({"results": str(root / f"results{world}.json"), "cases": plan_cases}))
        log = root / f"world{world}.log"
        rc = run_case(world, "tests.pretrain.ckpt_worker", [str(plan)], log, timeout=900)
        assert rc == 0, log_text(log)[-4000:]
        results = json.loads((root / f"results{world}.json").read_text())
        failed = {k: v.get("traceback", v["error"]) for k, v in results.items() if not v["ok"]}
        assert not failed, failed
    return root


@pytest.mark.parametrize("name", tiers.params(list(CASES), FULL))
def test_placement_matches_single_rank(placement_runs, name):
    """Per-step losses and grad norms equal one rank's; a resharded load continues steps 3-4 as the uninterrupted
    run."""
    world, config, overrides, source = CASES[name]
    ref, got = by_step(_reference(config, overrides)), by_step(placement_runs / name)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    rel = {(s, k): abs(got[s][k] - ref[s][k]) / abs(ref[s][k]) for s in got for k in ("loss", "grad_norm")}
    print(f"{name}: losses {[got[s]['loss'] for s in sorted(got)]} vs one rank "
          f"{[ref[s]['loss'] for s in sorted(ref)]}; max relative diff (loss, grad norm) {max(rel.values()):.2e}")
    assert max(rel.values()) <= TOLERANCE, (name, rel)
    if source is not None:  # steps 1-2 are the source's metrics, copied with its checkpoint
        assert [got[s]["consumed_samples"] for s in (3, 4)] == [ref[s]["consumed_samples"] for s in (3, 4)]
    assert got[STEPS]["loss"] != got[1]["loss"]


@tiers.full
def test_hf_export_of_a_layout_run(placement_runs, tmp_path):
    """`convert to-hf` of the layout run's step-4 checkpoint equals that of the run resumed at the even split."""
    import torch

    from data_tools.convert import main as convert
    from tests.data_tools.hf_families import safetensors_dir

    out = {}
    for name in ("llama_pp2_vp2_layout", "llama_layout_to_even"):
        assert convert(["to-hf", "--checkpoint", str(placement_runs / name), "--output", str(tmp_path / name),
                        "--no-progress"]) == 0
        out[name] = safetensors_dir(tmp_path / name)
    layout, even = out["llama_pp2_vp2_layout"], out["llama_layout_to_even"]
    assert sorted(layout) == sorted(even) and len(layout) == 3 + 6 * 9, sorted(layout)
    worst = max(float((layout[k] - even[k]).abs().max() / even[k].abs().max()) for k in layout)
    print(f"HF export, layout vs even split after a resharded load: max relative difference {worst:.2e}")
    assert all(torch.allclose(layout[k], even[k], rtol=1e-5, atol=1e-7) for k in layout)
