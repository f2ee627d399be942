"""Multi-Token Prediction and pipeline placement of hybrid models (Nemotron-H, Megatron-Core's `HybridModel`), on
the release that has them (0.19+: the unified pattern's `/` MTP depths and `|` segment boundaries), through
`train()` on CPU (gloo); refused with the reason on 0.16.1 (its `MambaModel` has no MTP and splits the stages itself).

`tiny_nemotron_h` with two MTP depths of `M*E` (a Mamba, an attention and an MoE layer each) trains 4 steps in fp32
on mock data; each layout's losses, gradient norms and MTP losses must equal the one-rank run's to 1e-5 relative.
`make test-mcore` (0.19.2) trains TP2 + SP and PP2 with an uneven placement (`Et|tttttmmL`: the first stage one layer,
the last five, the MTP depths and the loss) in one pool case on 2 ranks; `make test-all` adds the even PP2 split,
PP2 × VP2 by a layout string and by the embedding / loss in the split, EP2, DP2 with the distributed optimizer, and
the TP2 checkpoint resumed at TP1.
"""

from __future__ import annotations

import pytest

from pretrain.compat import hybrid as compat
from pretrain.config import load_config
from pretrain.validate import validate
from tests import tiers
from tests.pretrain.ckpt_helpers import by_step, layout_case, max_rel, rel_diff, run_worker_cases, step_values

CONFIG = "tiny_nemotron_h"
STEPS = 4
TOLERANCE = 1e-5
MTP = ["model.mtp_num_layers=2", "model.mtp_layer_pattern='M*E'"]
BASE = ["data.mock=true", f"train.steps={STEPS}", "train.precision=fp32", "train.global_batch_size=4",
        "train.micro_batch_size=2", "checkpoint.save_at_end=false", "checkpoint.interval=null",
        "logging.tensorboard=false", "optimizer.warmup_steps=1", *MTP]
TP2_SP = ["parallel.tensor=2", "parallel.sequence_parallel=true"]
# name: (overrides, copy_from source or None); all on 2 ranks.
LAYOUTS = {
    "tp2_sp": (TP2_SP + ["checkpoint.interval=2"], None),
    "pp2_uneven": (["parallel.pipeline=2", "parallel.pipeline_layout='Et|tttttmmL'"], None),
    "pp2": (["parallel.pipeline=2"], None),
    "pp2_vp2_layout": (["parallel.pipeline=2", "parallel.virtual_pipeline=2",
                        "parallel.pipeline_layout='Et|tt|tt|tmmL'"], None),
    "pp2_vp2_split": (["parallel.pipeline=2", "parallel.virtual_pipeline=2",
                       "parallel.account_for_embedding_in_pipeline_split=true",
                       "parallel.account_for_loss_in_pipeline_split=true"], None),
    "ep2": (["parallel.expert=2"], None),
    "dp2_distopt": (["optimizer.distributed=true"], None),
    "tp2_to_tp1": ([], "tp2_sp"),  # DP2 at TP1 from the TP2 run's step-2 checkpoint
}
FULL = {"pp2", "pp2_vp2_layout", "pp2_vp2_split", "ep2", "dp2_distopt", "tp2_to_tp1"}
needs_019 = pytest.mark.skipif(compat.MTP_REASON is not None, reason="Megatron-Core 0.16.1-0.18: no hybrid MTP "
                               "(refused: test_hybrid_mtp_and_placement_refused_before_0_19_accepted_after)")


@pytest.fixture(scope="module")
def mtp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_mtp")
    by_world = {1: [layout_case(root, CONFIG, BASE, "ref", [], None)],
                2: [layout_case(root, CONFIG, BASE, name, extra, source)
                    for name, (extra, source) in tiers.pick(LAYOUTS, FULL).items()]}
    for world, cases in by_world.items():
        (root / f"w{world}").mkdir()
        run_worker_cases(root / f"w{world}", world, cases, timeout=1800)
    return root


@pytest.mark.slow
@pytest.mark.mcore
@needs_019
@pytest.mark.parametrize("name", tiers.params([n for n in LAYOUTS if n != "tp2_to_tp1"], FULL))
def test_hybrid_mtp_layout_matches_one_rank(mtp_runs, name):
    root = mtp_runs
    ref, got = by_step(root / "ref"), by_step(root / name)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    loss = max_rel(step_values(root / name, "loss"), step_values(root / "ref", "loss"))
    norm = max_rel(step_values(root / name, "grad_norm"), step_values(root / "ref", "grad_norm"))
    mtp = max(rel_diff(a, b) for s in ref for a, b in zip(got[s]["mtp_loss_per_layer"], ref[s]["mtp_loss_per_layer"]))
    print(f"| tiny_nemotron_h + MTP 2 × M*E | {name} | loss {loss:.1e} | grad norm {norm:.1e} | MTP loss {mtp:.1e} |")
    assert loss <= TOLERANCE and norm <= TOLERANCE and mtp <= TOLERANCE, (name, loss, norm, mtp)
    assert len(ref[1]["mtp_loss_per_layer"]) == 2 and got[STEPS]["loss"] != got[1]["loss"]
    # the MTP depths' routers have their own rows (after the decoder's 6): 2 depths × 3 layers, E the third
    assert len(got[1]["moe_tokens_per_expert"]) == 12 and sum(got[1]["moe_tokens_per_expert"][8]) > 0


@pytest.mark.slow
@pytest.mark.mcore
@needs_019
@pytest.mark.full
def test_hybrid_mtp_tp2_checkpoint_resumes_at_tp1(mtp_runs):
    """The TP2 checkpoint (the MTP depths' Mamba in-projections stored part by part, like the decoder's) loads at
    TP1 and continues as the TP2 run did."""
    ref, got = by_step(mtp_runs / "tp2_sp"), by_step(mtp_runs / "tp2_to_tp1")
    for s in (3, 4):
        rel = rel_diff(got[s]["loss"], ref[s]["loss"])
        print(f"hybrid MTP TP2 → TP1 step {s}: loss {got[s]['loss']!r} vs {ref[s]['loss']!r} ({rel:.1e})")
        assert got[s]["consumed_samples"] == ref[s]["consumed_samples"] and rel <= TOLERANCE


def _errors(overrides: list[str], world: int) -> list[str]:
    report = validate(load_config(CONFIG, ["data.mock=true", *overrides]), world, files=False)
    return [str(p) for p in report.errors]


@pytest.mark.mcore
def test_hybrid_mtp_and_placement_refused_before_0_19_accepted_after():
    """0.16.1: MTP, layout strings, the embedding / loss in the split and virtual stages refused, each naming its key
    and the release's reason; 0.19+: the same configs validate (the placement becomes the pattern's `|` segments)."""
    cases = {"MTP": (MTP, 1, "[model.hybrid_layer_pattern, model.mtp_num_layers] Multi-Token Prediction in a hybrid "
                             "model: Megatron-Core's MambaModel has none (0.16.1-0.18)"),
             "layout": (["parallel.pipeline=2", "parallel.pipeline_layout='Et|tttttL'"], 2,
                        "[model.hybrid_layer_pattern, parallel.pipeline_layout] parallel.pipeline_layout places GPT "
                        "decoder layers; Megatron-Core's MambaStack ignores pipeline_model_parallel_layout"),
             "split": (["parallel.pipeline=2", "parallel.account_for_embedding_in_pipeline_split=true",
                        "parallel.account_for_loss_in_pipeline_split=true"], 2,
                       "parallel.account_for_embedding_in_pipeline_split places GPT decoder layers"),
             "VP": (["parallel.pipeline=2", "parallel.virtual_pipeline=3"], 2,
                    "[model.hybrid_layer_pattern, parallel.virtual_pipeline] a hybrid model's virtual pipeline: "
                    "Megatron-Core's MambaStack asserts there is none")}
    for name, (overrides, world, message) in cases.items():
        errors = _errors(overrides, world)
        if compat.MTP_REASON is None:
            assert not errors, (name, errors)
        else:
            assert any(message in e for e in errors), (name, errors)


@pytest.mark.mcore
@needs_019
def test_hybrid_mtp_pattern_refusals_name_their_keys():
    cases = {"no pattern": (["model.mtp_num_layers=2"], "[model.mtp_num_layers, model.mtp_layer_pattern] "
                            "model.mtp_num_layers=2 in a hybrid model needs the layers of each MTP depth"),
             "no depths": (["model.mtp_layer_pattern='*E'"], "[model.mtp_layer_pattern, model.mtp_num_layers] "
                           "model.mtp_layer_pattern='*E' gives the layers of one MTP depth, but model.mtp_num_layers"),
             "symbol": (["model.mtp_num_layers=1", "model.mtp_layer_pattern='*X'"], "[model.mtp_layer_pattern] "
                        "model.mtp_layer_pattern='*X' has the unknown symbol(s) 'X'"),
             "experts": (["model.mtp_num_layers=1", "model.mtp_layer_pattern='*E'", "model.hybrid_layer_pattern=M*M-MM",
                          "model.num_moe_experts=null"], "model.mtp_layer_pattern='*E' has MoE layer(s) (E) but "
                         "model.num_moe_experts is null"),
             "MTP off the last stage": (MTP + ["parallel.pipeline=2", "parallel.pipeline_layout='Ettttmm|ttL'"],
                                        "parallel.pipeline_layout")}
    for name, (overrides, message) in cases.items():
        errors = _errors(overrides, 2 if "parallel.pipeline=2" in overrides else 1)
        assert any(message in e for e in errors), (name, errors)


def test_gpt_refuses_a_hybrid_mtp_pattern():
    errors = [str(p) for p in validate(load_config("tiny_llama", ["data.mock=true", "model.mtp_num_layers=1",
                                                                 "model.mtp_layer_pattern='*E'"]), 1,
                                       files=False).errors]
    assert any("[model.mtp_layer_pattern] model.mtp_layer_pattern gives a hybrid model's MTP layers" in e
               for e in errors), errors


# Megatron-Bridge's published Nemotron 3 Super run (26.04.01, GB300, 8192): 795 model TFLOP/s and 9,344 tokens/s per
# GPU, with its recipe's two MTP depths of `*E`.
SUPER_PUBLISHED = 795e12 / 9344


def test_super_flops_with_its_mtp_depths_match_the_published_figure():
    """Megatron-Bridge's hybrid count with the recipe's MTP (2 × `*E`, and their logits): within 1% of the
    published TFLOP/s ÷ tokens/s; without MTP 11% below it (what the planner said before)."""
    from model_providers.core.hybrid import flops_per_token

    on = load_config(None, ["model.preset=nemotron3_super", "model.seq_length=8192", "model.mtp_num_layers=2",
                            "model.mtp_layer_pattern='*E'"]).model
    off = load_config(None, ["model.preset=nemotron3_super", "model.seq_length=8192"]).model
    with_mtp, without = flops_per_token(on, 131072), flops_per_token(off, 131072)
    print(f"nemotron3_super FLOPs/token: {with_mtp:.4e} with MTP, {without:.4e} without; published "
          f"{SUPER_PUBLISHED:.4e}")
    assert abs(with_mtp / SUPER_PUBLISHED - 1) < 0.01 and without / SUPER_PUBLISHED < 0.9
