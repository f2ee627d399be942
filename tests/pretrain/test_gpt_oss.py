"""GPT-OSS on CPU (gloo), through `train()`: every layout equals one rank; checkpoints reshard between EP sizes; the
validate refusals of what does not combine.

`tiny_gpt_oss` (pretrain/configs/tiny_gpt_oss.yaml: window 8 < sequence 32 on layers 1 and 3, full attention on 2
and 4, learnable sinks, biases on attention, router and experts, 4 clamped-SwiGLU experts top-2, YaRN) trains 4 steps
in fp32 on mock data. Each layout's losses, gradient norms and router (aux) losses must equal the one-rank run's to
1e-5 relative. `make test` runs TP2 + SP × EP2 (expert TP 1) on 2 ranks; `make test-all` adds EP2, TP2 + SP, PP2,
CP2 (a2a and all_gather: our `ContextParallelAttention` with sinks), the distributed optimizer at EP2, and the EP2
checkpoint resumed at EP1. Pool cases: world 1 (the reference) and world 2.
"""

from __future__ import annotations

import pytest

from pretrain.config import load_config
from pretrain.validate import validate
from tests import tiers
from tests.pretrain.ckpt_helpers import by_step, rel_diff
from tests.pretrain.doc_helpers import assert_packed_equals_alone
from tests.pretrain.family_helpers import (
    STEPS,
    TP2_SP,
    assert_layout_matches_one_rank,
    family_runs,
)

pytestmark = pytest.mark.slow

EP2 = ["parallel.expert=2"]
CP2 = ["parallel.context=2"]
# name: (overrides, copy_from source or None); all on 2 ranks (EP folds into TP / DP).
LAYOUTS = {
    "tp2_sp_ep2": (TP2_SP + EP2, None),
    "ep2": (EP2 + ["checkpoint.interval=2"], None),
    "tp2_sp": (TP2_SP, None),
    "pp2": (["parallel.pipeline=2"], None),
    "cp2_a2a": (CP2 + ["parallel.cp_comm_type=a2a"], None),
    "cp2_all_gather": (CP2 + ["parallel.cp_comm_type=all_gather"], None),
    "dp2_distopt_ep2": (EP2 + ["optimizer.distributed=true"], None),
    "ep2_to_ep1": ([], "ep2"),  # DP2 at EP1 from the EP2 run's step-2 checkpoint
}
FULL = set(LAYOUTS) - {"tp2_sp_ep2"}
# Packed documents (THD, window 8 shorter than each document): our ContextParallelAttention with sinks at CP1 and
# CP2 a2a against each document alone (Megatron-Core's DotProductAttention with SoftmaxOne). `make test-all` only.
DOC_LAYOUTS = {"docs_cp1": [], "docs_cp2_a2a": CP2 + ["parallel.cp_comm_type=a2a"]}


@pytest.fixture(scope="module")
def gpt_oss_runs(tmp_path_factory):
    """The reference and the packed-document cases on world 1, the layouts on world 2. Returns (root, the documents'
    prediction counts)."""
    return family_runs(tmp_path_factory.mktemp("gpt_oss"), "tiny_gpt_oss", LAYOUTS, FULL, DOC_LAYOUTS, timeout=1200)


@pytest.mark.mcore
@pytest.mark.parametrize("name", tiers.params([n for n in LAYOUTS if n != "ep2_to_ep1"], FULL))
def test_gpt_oss_layout_matches_one_rank(gpt_oss_runs, name):
    assert_layout_matches_one_rank(gpt_oss_runs[0], "tiny_gpt_oss", name, "moe_load_balancing_loss")


@pytest.mark.full
def test_gpt_oss_ep2_checkpoint_resumes_at_ep1(gpt_oss_runs):
    root, _ = gpt_oss_runs
    ref, got = by_step(root / "ep2"), by_step(root / "ep2_to_ep1")
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in (3, 4):
        rel = rel_diff(got[s]["loss"], ref[s]["loss"])
        print(f"tiny_gpt_oss EP2 → EP1 step {s}: loss {got[s]['loss']!r} vs {ref[s]['loss']!r} ({rel:.1e})")
        assert got[s]["consumed_samples"] == ref[s]["consumed_samples"] and rel <= 2e-6


@pytest.mark.full
@pytest.mark.parametrize("name", list(DOC_LAYOUTS))
def test_gpt_oss_packed_documents_equal_documents_alone(gpt_oss_runs, name):
    """THD with sinks and a window of 8 (our attention) = each document alone (Megatron-Core's SoftmaxOne)."""
    root, predictions = gpt_oss_runs
    assert_packed_equals_alone(root, predictions, name, "tiny_gpt_oss ")


REFUSED = {
    "sinks p2p on CPU": (CP2 + ["parallel.cp_comm_type=p2p"], 2, False,
                         "[model.softmax_type, parallel.cp_comm_type] attention sinks (model.softmax_type=learnable) "
                         "with cp_comm_type=p2p: the CPU ring attention"),
    "sinks all_gather with TE": (CP2 + ["parallel.cp_comm_type=all_gather"], 2, True,
                                 "Transformer Engine's context-parallel attention takes attention sinks "
                                 "(model.softmax_type=learnable) only with cp_comm_type a2a, not all_gather"),
    "biased experts at expert TP 2": (TP2_SP + ["parallel.expert_tensor=2"], 2, False,
                                      "[model.add_bias_linear, parallel.expert_tensor] experts with biases"),
    "clamp without GLU": (["model.gated_linear_unit=false"], 1, False,
                          "[model.glu_linear_offset, model.gated_linear_unit] model.glu_linear_offset=1.0 acts on a "
                          "gated MLP"),
    "YaRN factor": (["model.rotary_scaling_factor=0.5"], 1, False, "YaRN needs model.rotary_scaling_factor >= 1"),
    "sinks with MLA": (["model.multi_latent_attention=true"], 1, False,
                       "[model.softmax_type, model.multi_latent_attention]"),
}


def test_gpt_oss_combinations_are_validated():
    """Each bad combination is a problem naming its keys; sinks under CP are accepted on CPU with a2a and all_gather
    and with Transformer Engine with a2a."""
    for case_name, (overrides, world, te, message) in REFUSED.items():
        report = validate(load_config("tiny_gpt_oss", overrides), world, te_on_gpu=te, cuda_available=te, files=False)
        assert [str(p) for p in report.errors if message in str(p)], (case_name, [str(p) for p in report.errors])
    for comm, te in (("a2a", False), ("all_gather", False), ("a2a", True)):
        cfg = load_config("tiny_gpt_oss", [*CP2, f"parallel.cp_comm_type={comm}"])
        assert not validate(cfg, 2, te_on_gpu=te, cuda_available=te, files=False).errors, comm


def test_published_120b_layout_validates_on_mock_data():
    """launch/pretrain_gpt_oss_120b.sh as `validate --world-size 64` checks it (a GPU dry run): Megatron-Bridge's H100
    layout (TP1, PP4, EP8, DP16, GBS 1280) is accepted; the planner's parameter counts (sinks and biases included) are
    transformers' (its meta-device GptOssForCausalLM of each released config)."""
    from pretrain.layout import derive_layout
    from pretrain.plan import count_parameters
    from tests.pretrain.test_placement_config import _launch_overrides

    config, overrides = _launch_overrides("pretrain_gpt_oss_120b.sh", {})
    cfg = load_config(config, [*overrides, "data.mock=true"])
    report = validate(cfg, 64, gpu_dry_run=True, cuda_available=False)
    assert report.ok, report.text()
    lay = derive_layout(cfg, 64, vocab_size=cfg.model.vocab_size)
    assert (lay.tp, lay.pp, lay.ep, lay.etp, lay.dp) == (1, 4, 8, 1, 16)
    assert cfg.train.global_batch_size == 1280 and cfg.model.seq_length == 4096
    assert count_parameters(cfg, cfg.model.vocab_size) == 116_829_156_672  # GptOssForCausalLM(gpt-oss-120b)
    small = load_config("gpt_oss_20b", ["data.mock=true"])
    assert count_parameters(small, small.model.vocab_size) == 20_914_757_184  # ... and of gpt-oss-20b
