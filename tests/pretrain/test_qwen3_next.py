"""Qwen3-Next on CPU (gloo), through `train()`: every layout equals one rank; checkpoints reshard from TP2 to TP1;
kill -9 and resume reproduce every number; packed documents equal the documents alone; the validate refusals.

`tiny_qwen3_next` (pretrain/configs/tiny_qwen3_next.yaml: Gated DeltaNet on layers 1 and 3, output-gated full
attention with RoPE on a quarter of the head on 2 and 4, zero-centred norms, 4 experts top-2 + a gated shared expert,
sequence 128 = two chunks of the delta rule) trains 4 steps in fp32 on mock data. Each layout's losses, gradient norms
and router (aux) losses must equal the one-rank run's to 1e-5 relative. `make test` trains TP2 + SP, PP2 (the layout
string `Ett|ttL`), EP2, DP2 with the distributed optimizer, the TP2 checkpoint resumed at TP1 and continued by
Megatron-FSDP in one 2-rank pool case (and the reference on one rank); `make test-all` adds TP2 + SP × EP2, PP2,
kill -9 + resume, and packed documents.
"""

from __future__ import annotations

import json

import pytest

from pretrain.config import load_config
from pretrain.validate import validate
from tests import tiers
from tests.pretrain.ckpt_helpers import (
    DETERMINISTIC,
    by_step,
    command,
    kill9_and_resume,
    metrics,
    rel_diff,
)
from tests.pretrain.doc_helpers import assert_packed_equals_alone
from tests.pretrain.family_helpers import (
    BASE,
    STEPS,
    TOLERANCE,
    TP2_SP,
    assert_layout_matches_one_rank,
    family_runs,
)

pytestmark = pytest.mark.slow

CONFIG = "tiny_qwen3_next"
# name: (overrides, copy_from source or None); all on 2 ranks (EP folds into TP / DP).
LAYOUTS = {
    "tp2_sp": (TP2_SP + ["checkpoint.interval=2"], None),
    "pp2_layout": (["parallel.pipeline=2", "parallel.pipeline_layout=Ett|ttL"], None),
    "ep2": (["parallel.expert=2"], None),
    "dp2_distopt": (["optimizer.distributed=true"], None),
    "tp2_sp_ep2": (TP2_SP + ["parallel.expert=2", "parallel.expert_tensor=1"], None),
    "pp2": (["parallel.pipeline=2"], None),
    "tp2_to_tp1": ([], "tp2_sp"),  # DP2 at TP1 from the TP2 run's step-2 checkpoint (in_proj split by parts)
    # Megatron-FSDP DP2 from the same torch_dist checkpoint (weights only: the MoE optimizer's state does not cross)
    "fsdp_from_tp2": (["optimizer.fsdp=true", "checkpoint.load_optimizer=false"], "tp2_sp"),
}
RESUMED = {"tp2_to_tp1", "fsdp_from_tp2"}
FULL = {"tp2_sp_ep2", "pp2"}


@pytest.fixture(scope="module")
def qwen3_next_runs(tmp_path_factory):
    """The reference (and, in `make test-all`, the packed-document cases) on world 1, the layouts on world 2.
    Returns (root, the documents' prediction counts)."""
    return family_runs(tmp_path_factory.mktemp("qwen3_next"), CONFIG, LAYOUTS, FULL,
                       {"docs_packed": [], "docs_tp2_sp": TP2_SP})


@pytest.mark.mcore
@pytest.mark.parametrize("name", tiers.params([n for n in LAYOUTS if n not in RESUMED], FULL))
def test_qwen3_next_layout_matches_one_rank(qwen3_next_runs, name):
    assert_layout_matches_one_rank(qwen3_next_runs[0], CONFIG, name, "moe_load_balancing_loss")


@pytest.mark.mcore
def test_qwen3_next_tp2_checkpoint_resumes_at_tp1(qwen3_next_runs):
    """Gated DeltaNet's fused in_proj (and conv1d) are stored split into their parts (query, key, value, z, beta,
    alpha), each split over TP on its own: the TP2 checkpoint loads at TP1 and continues with the TP2 run's losses.
    The load's dropped-weight check (`pretrain/checkpoint/dropped.py`) finds a place for every part."""
    root, _ = qwen3_next_runs
    ref, got = by_step(root / "tp2_sp"), by_step(root / "tp2_to_tp1")
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in (3, 4):
        rel = rel_diff(got[s]["loss"], ref[s]["loss"])
        print(f"tiny_qwen3_next TP2 → TP1 step {s}: loss {got[s]['loss']!r} vs {ref[s]['loss']!r} ({rel:.1e})")
        assert got[s]["consumed_samples"] == ref[s]["consumed_samples"] and rel <= 2e-6


@pytest.mark.mcore
def test_qwen3_next_torch_dist_checkpoint_continues_in_megatron_fsdp(qwen3_next_runs):
    """torch_dist keeps Gated DeltaNet's in_proj and conv1d in parts, Megatron-FSDP's fsdp_dtensor whole
    (`pretrain/checkpoint/parts.py`): the TP2 run's step-2 checkpoint loads into Megatron-FSDP at DP2 (weights only)
    and step 3 (the loaded weights' forward and backward) equals the TP2 run's step 3."""
    root, _ = qwen3_next_runs
    ref, got = by_step(root / "tp2_sp"), by_step(root / "fsdp_from_tp2")
    loss, norm = rel_diff(got[3]["loss"], ref[3]["loss"]), rel_diff(got[3]["grad_norm"], ref[3]["grad_norm"])
    print(f"tiny_qwen3_next TP2 torch_dist → FSDP DP2, step 3: loss {loss:.1e}, grad norm {norm:.1e}")
    assert {3, 4} <= set(got) and loss <= TOLERANCE and norm <= TOLERANCE, (loss, norm)


@pytest.mark.full
def test_qwen3_next_kill9_and_resume_reproduce_every_number(qwen3_next_runs, tmp_path):
    root, _ = qwen3_next_runs
    work = tmp_path / "run"
    cmd = command([], nproc=2, args=["train", CONFIG, *BASE, *TP2_SP, "checkpoint.interval=1", f"run.dir={work}"])
    kill_at = kill9_and_resume(cmd, work, STEPS)
    keys = DETERMINISTIC + ("moe_load_balancing_loss", "moe_tokens_per_expert")
    got = [tuple(json.dumps(m[k]) for k in keys) for m in metrics(work) if "loss" in m]
    want = [tuple(json.dumps(m[k]) for k in keys) for m in metrics(root / "tp2_sp") if "loss" in m]
    print(f"killed after step {kill_at}; {len(got)} steps compared exactly")
    assert len(got) == STEPS and got == want


@pytest.mark.full
@pytest.mark.parametrize("name", ["docs_packed", "docs_tp2_sp"])
def test_qwen3_next_packed_documents_equal_documents_alone(qwen3_next_runs, name):
    """THD: Gated DeltaNet resets its convolution and state at each document, full attention masks by document."""
    root, predictions = qwen3_next_runs
    assert_packed_equals_alone(root, predictions, name, "tiny_qwen3_next ")


REFUSED = {
    "GDN with CP": (["parallel.context=2"], 2, False,
                    "[model.experimental_attention_variant, parallel.context] Gated DeltaNet layers have no "
                    "context-parallel path"),
    "heads vs TP": (["parallel.tensor=4", "parallel.sequence_parallel=true", "model.num_query_groups=4"], 4, False,
                    "[model.linear_num_key_heads, model.linear_num_value_heads, parallel.tensor] Gated DeltaNet's "
                    "heads are split over tensor parallelism"),
    "interval beyond the layers": (["model.linear_attention_freq=5"], 1, False,
                                   "[model.linear_attention_freq, model.num_layers] model.linear_attention_freq=5 "
                                   "does not fit model.num_layers=4"),
    "pattern length": (["model.linear_attention_freq=[1,0,1]"], 1, False, "model.linear_attention_freq as a list"),
    "MTP after a linear layer": (["model.mtp_num_layers=1", "model.linear_attention_freq=[0,1,0,1]"], 1, False,
                                 "[model.linear_attention_freq, model.mtp_num_layers]"),
    "value heads": (["model.linear_num_value_heads=3"], 1, False, "[model.linear_num_value_heads, "
                    "model.linear_num_key_heads] model.linear_num_value_heads=3 must be a multiple"),
    "TE without SP": (["parallel.tensor=2"], 2, True, "[model.experimental_attention_variant, parallel.tensor, "
                      "parallel.sequence_parallel] with Transformer Engine"),
    "no variant": (["model.experimental_attention_variant=null"], 1, False,
                   "[model.linear_attention_freq, model.experimental_attention_variant]"),
}


def test_qwen3_next_combinations_are_validated():
    """Each bad combination is a problem naming its keys; the preset validates at TP2 + SP, PP2, EP2 (CPU) and as a
    GPU job."""
    for case_name, (overrides, world, te, message) in REFUSED.items():
        report = validate(load_config(CONFIG, overrides), world, te_on_gpu=te, cuda_available=te, files=False)
        assert [str(p) for p in report.errors if message in str(p)], (case_name, [str(p) for p in report.errors])
    for overrides, te in ((TP2_SP, False), (["parallel.pipeline=2"], False), (["parallel.expert=2"], False),
                          (TP2_SP, True)):
        report = validate(load_config(CONFIG, overrides), 2, te_on_gpu=te, cuda_available=te, files=False)
        assert not report.errors, (overrides, [str(p) for p in report.errors])


# --------------------------------------------------------------------------------------------------
# Presets, parameter counts, FLOPs, the published-size config
# --------------------------------------------------------------------------------------------------

# preset: (transformers' count of its meta-device model, the model card's total in billions)
RELEASED_SIZES = {"qwen3_next_80b_a3b": (79_674_391_296, 80), "qwen3_5_35b_a3b": (34_660_610_688, 35)}


@pytest.mark.parametrize("preset", sorted(RELEASED_SIZES))
def test_preset_parameter_count_is_transformers(preset):
    """The planner's count (Gated DeltaNet layers, gated attention, the shared-expert gate) = transformers' model of the
    preset built on the meta device, and rounds to the model card's size (80B, 35B: the MTP layer aside, as
    transformers builds none)."""
    import torch
    from transformers import AutoModelForCausalLM

    from model_providers import get_family
    from pretrain.plan import count_parameters

    cfg = load_config(None, [f"model.preset={preset}"])
    m = cfg.model
    ours = count_parameters(cfg, m.vocab_size)
    hf_cfg = get_family(m.family).to_hf_config(m, m.vocab_size, bos=None, eos=None, dtype=torch.bfloat16)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_cfg).parameters())
    print(f"{preset}: {ours:,} parameters (transformers {theirs:,}; model card {RELEASED_SIZES[preset][1]}B)")
    assert ours == theirs == RELEASED_SIZES[preset][0] and round(ours / 1e9) == RELEASED_SIZES[preset][1]


def test_flops_per_token_is_megatron_lm_accounting():
    """FLOPs per token of qwen3_next_80b_a3b at 4096 tokens = Megatron-LM's `num_floating_point_operations` terms
    written out here (6 FLOPs per weight per token; Gated DeltaNet's in_proj, conv, delta rule (4·n_v·d_v²),
    out_proj; gated attention's q, gate, k, v, out projections and causal scores; top-k + shared experts and the
    router; the logits; the MTP layer, a full-attention MoE layer with its 2h → h projection and its logits)."""
    from pretrain.observe.flops import flops_per_token

    m = load_config(None, ["model.preset=qwen3_next_80b_a3b", "model.seq_length=4096"]).model
    h, s, vocab = 2048, 4096, 151936
    qk, v, nv = 16 * 128, 32 * 128, 32
    gdn = h * (2 * qk + 2 * v + 2 * nv) + 4 * (2 * qk + v) + 4 * nv * 128 * 128 + h * v
    q, kv = 16 * 256, 2 * 256
    attention = h * (q + 2 * kv + q) + q * s / 2 * 2 + q * h
    moe = h * (512 * 10 * 3 + 512 * 3) + 512 * h
    layers = 36 * gdn + 12 * attention + 48 * moe
    mtp = attention + moe + 2 * h * h + h * vocab
    want = 6 * (layers + h * vocab + mtp)
    got = flops_per_token(m, vocab)
    print(f"qwen3_next_80b_a3b at 4096: {got:.6g} FLOPs/token (by hand {want:.6g})")
    assert abs(got - want) / want < 1e-12


def test_published_size_config_plans_and_validates():
    """pretrain/configs/qwen3_next_80b_a3b.yaml validates as a 32-GPU job (a GPU dry run) and the planner fits it."""
    from pretrain.planner.plan import make_plan

    cfg = load_config("qwen3_next_80b_a3b", ["data.mock=true"])
    report = validate(cfg, 32, gpu_dry_run=True, cuda_available=False)
    assert report.ok, report.text()
    result = make_plan(cfg, nodes=4, gpus_per_node=8, gpu="h100")
    assert result["fits"], result
