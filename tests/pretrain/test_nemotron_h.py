"""Nemotron-H (hybrid Mamba-2 / attention / MLP / MoE, Megatron-Core's `MambaModel`) on CPU (gloo), through
`train()`: every layout equals one rank; checkpoints reshard (TP2 → TP1: Mamba's fused in-projection is stored part
by part); packed documents equal the documents alone; the refusals of what does not combine.

`tiny_nemotron_h` (pretrain/configs/tiny_nemotron_h.yaml: pattern M*M-ME, the CPU Mamba mixer, squared-ReLU MLP and
experts, Nemotron 3's sigmoid router with expert bias and a shared expert, no position encoding) trains 4 steps in
fp32 on mock data. Each layout's losses and gradient norms must equal the one-rank run's to 1e-5 relative, and its
router (aux) losses too. `make test` trains TP2 + SP, PP2 (the pattern split M*M | -ME as Megatron-Core splits it),
EP2, DP2 with the distributed optimizer and CP2 (Megatron-Core's Mamba all-to-all context parallelism) in one pool
case on 2 ranks, and the TP2 checkpoint resumed at TP1; `make test-all` adds TP2 + SP × EP2 and packed documents.
"""

from __future__ import annotations

import pytest

from pretrain.config import load_config
from pretrain.validate import validate
from tests import tiers
from tests.pretrain.ckpt_helpers import (
    DETERMINISTIC,
    by_step,
    command,
    kill9_and_resume,
    layout_case,
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

CONFIG = "tiny_nemotron_h"
EP2 = ["parallel.expert=2"]
# name: (overrides, copy_from source or None); all on 2 ranks (EP folds into TP / DP).
LAYOUTS = {
    "tp2_sp": (TP2_SP + ["checkpoint.interval=2"], None),
    "pp2": (["parallel.pipeline=2"], None),
    "ep2": (EP2, None),
    "dp2_distopt": (["optimizer.distributed=true"], None),
    "cp2": (["parallel.context=2"], None),
    "tp2_to_tp1": ([], "tp2_sp"),  # DP2 at TP1 from the TP2 run's step-2 checkpoint
    "tp2_sp_ep2": (TP2_SP + EP2, None),
}
FULL = {"tp2_sp_ep2"}
# A run in two stages (docs/training.md "Stages"): the boundary rebuilds the MambaModel and loads the first stage's
# checkpoint; the second stage reads its data from its own first sample. `staged` changes the SSD scan's chunk there
# (8 → 16, sequence 32: the same recurrence, rounded otherwise), `staged_same` keeps it.
STAGES = {name: f"stages=[{{name: first, steps: 2}}, {{name: second, steps: 2, set: {{{sets}}}}}]"
          for name, sets in (("staged", "model.mamba_chunk_size: 16"), ("staged_same", "optimizer.lr: 1.0e-3"))}
# packed documents (THD) at one and two ranks; under CP the THD order around Mamba's all-to-all is ours (cp_layout)
DOC_LAYOUTS = {"docs_tp1": [], "docs_tp2_sp": TP2_SP, "docs_cp2": ["parallel.context=2"]}


@pytest.fixture(scope="module")
def nemotron_runs(tmp_path_factory):
    """The reference and the packed-document cases on world 1, the layouts on world 2. Returns (root, the documents'
    prediction counts)."""
    root = tmp_path_factory.mktemp("nemotron_h")
    staged = [layout_case(root, CONFIG, BASE, name, [stages], None) for name, stages in STAGES.items()]
    return family_runs(root, CONFIG, LAYOUTS, FULL, DOC_LAYOUTS, more_world1=staged)


@pytest.mark.mcore
@pytest.mark.parametrize("name", tiers.params([n for n in LAYOUTS if n != "tp2_to_tp1"], FULL))
def test_nemotron_h_layout_matches_one_rank(nemotron_runs, name):
    assert_layout_matches_one_rank(nemotron_runs[0], CONFIG, name, "moe_seq_load_balancing_loss")


@pytest.mark.mcore
def test_nemotron_h_tp2_checkpoint_resumes_at_tp1(nemotron_runs):
    """The TP2 checkpoint (in-projection and convolution stored as z/x/B/C/dt parts, each split over TP) loads at TP1
    and continues as the TP2 run did."""
    root, _ = nemotron_runs
    ref, got = by_step(root / "tp2_sp"), by_step(root / "tp2_to_tp1")
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in (3, 4):
        rel = rel_diff(got[s]["loss"], ref[s]["loss"])
        print(f"tiny_nemotron_h TP2 → TP1 step {s}: loss {got[s]['loss']!r} vs {ref[s]['loss']!r} ({rel:.1e})")
        assert got[s]["consumed_samples"] == ref[s]["consumed_samples"] and rel <= TOLERANCE


@pytest.mark.full
def test_nemotron_h_in_stages(nemotron_runs):
    """A hybrid run in two stages: the first stage is the plain run step for step; the second, started from the
    boundary checkpoint (stage_first) with another SSD chunk (model.mamba_chunk_size 8 → 16), equals the same stages
    with chunk 8 to rounding; and the second stage trains (its data from its own first sample: not the plain run's)."""
    root, _ = nemotron_runs
    ref, got, same = by_step(root / "ref"), by_step(root / "staged"), by_step(root / "staged_same")
    assert sorted(got) == sorted(same) == list(range(1, STEPS + 1))
    assert [got[s]["stage"] for s in got] == ["first", "first", "second", "second"]
    assert all(got[s]["loss"] == ref[s]["loss"] and got[s]["grad_norm"] == ref[s]["grad_norm"] for s in (1, 2))
    loss = max(rel_diff(got[s]["loss"], same[s]["loss"]) for s in (3, 4))
    norm = max(rel_diff(got[s]["grad_norm"], same[s]["grad_norm"]) for s in (3, 4))
    print(f"tiny_nemotron_h in stages, chunk 16 vs 8 in the second stage: loss {loss:.1e}, grad norm {norm:.1e}")
    assert loss <= TOLERANCE and norm <= TOLERANCE
    assert same[3]["loss"] != ref[3]["loss"]  # the second stage reads its own data from its first sample
    assert list((root / "staged").rglob("stage_first")), "the boundary checkpoint named for the first stage"


@pytest.mark.full  # kill -9 on a hybrid model; `make test` has test_resume.py's
def test_kill9_and_resume_reproduce_every_number_at_tp2(nemotron_runs, tmp_path):
    """Killed (SIGKILL, process group) after a random step or in its save, resumed by the same command: every
    step's loss, grad norm, lr, samples, router loss, expert load and expert bias as the uninterrupted TP2 run's."""
    import json

    root, _ = nemotron_runs
    work = tmp_path / "run"
    cmd = command([], nproc=2, args=["train", CONFIG, *BASE, *TP2_SP, "checkpoint.interval=1", f"run.dir={work}"])
    kill_at = kill9_and_resume(cmd, work, STEPS)
    keys = DETERMINISTIC + ("moe_seq_load_balancing_loss", "moe_tokens_per_expert", "moe_expert_bias")
    got = [tuple(json.dumps(m[k]) for k in keys) for m in metrics(work) if "loss" in m]
    want = [tuple(json.dumps(m[k]) for k in keys) for m in metrics(root / "tp2_sp") if "loss" in m]
    print(f"killed after step {kill_at}; {len(got)} steps compared exactly")
    assert len(got) == STEPS and got == want


@pytest.mark.full
@pytest.mark.parametrize("name", list(DOC_LAYOUTS))
def test_nemotron_h_packed_documents_equal_documents_alone(nemotron_runs, name):
    """THD: the Mamba state and convolution restart at each document, attention stays inside it = each document
    alone."""
    root, predictions = nemotron_runs
    assert_packed_equals_alone(root, predictions, name, "tiny_nemotron_h ")


_PATTERN = "[model.hybrid_layer_pattern, model.num_layers] model.hybrid_layer_pattern="
REFUSED = {
    "unknown symbol": (["model.hybrid_layer_pattern=M*X-ME"], 1,
                       _PATTERN + "'M*X-ME' has the unknown symbol(s) 'X' (known: M (Mamba-2), * (attention), "),
    "length": (["model.hybrid_layer_pattern=M*M-E"], 1, _PATTERN + "'M*M-E' has 5 symbols but model.num_layers=6"),
    "heads by TP": (["parallel.tensor=4", "parallel.sequence_parallel=true"], 4,
                    "[model.mamba_num_heads, model.mamba_num_groups, parallel.tensor] 8 Mamba heads and 2 groups must "
                    "both divide by parallel.tensor=4"),
    "heads by CP": (["model.mamba_num_heads=6", "model.mamba_num_groups=2", "parallel.context=2",
                     "parallel.tensor=2", "parallel.sequence_parallel=true"], 4,
                    "[model.mamba_num_heads, model.mamba_num_groups, parallel.context] Mamba's context parallelism"),
    "chunk": (["model.mamba_chunk_size=12"], 1, "[model.mamba_chunk_size] model.mamba_chunk_size=12: mamba_ssm's "
              "SSD scan kernels take a power of 2"),
    "conv width": (["model.mamba_conv_kernel=5"], 1, "[model.mamba_conv_kernel] model.mamba_conv_kernel=5 must be "
                   "in [2, 4] (the widths the causal_conv1d CUDA kernel takes)"),
    "dt range": (["model.mamba_dt_min=0.2"], 1, "[model.mamba_dt_min, model.mamba_dt_max] model.mamba_dt_min=0.2 is "
                 "above model.mamba_dt_max=0.1"),
    "state": (["model.mamba_state_dim=3"], 1, "the Mamba convolution has 76 channels per rank (x, B, C); the "
              "causal_conv1d CUDA kernel takes the channel-last layout only for a multiple of 8"),
    "experts without E": (["model.hybrid_layer_pattern=M*M-MM"], 1,
                          "model.num_moe_experts=4 but model.hybrid_layer_pattern has no MoE layer (E)"),
    # virtual stages, layout strings and MTP: refused on 0.16.1 only (test_hybrid_mtp.py)
    "full recompute": (["model.recompute_granularity=full", "model.recompute_method=uniform",
                        "model.recompute_num_layers=1"], 1, "full recompute: Megatron-Core's Mamba stack has no"),
    "FSDP": (["optimizer.fsdp=true"], 2, "[model.hybrid_layer_pattern, optimizer.fsdp] Megatron-FSDP with a hybrid"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_nemotron_h_refusals_name_their_keys(name):
    overrides, world, message = REFUSED[name]
    report = validate(load_config(CONFIG, ["data.mock=true", *overrides]), world, files=False)
    assert [str(p) for p in report.errors if message in str(p)], (name, [str(p) for p in report.errors])


def test_bad_pattern_is_one_line_at_the_cli():
    """`python -m pretrain validate` with a bad pattern: exit 2, the key named, no traceback."""
    from tests.cli import run_cli

    r = run_cli("pretrain", ["validate", CONFIG, "model.hybrid_layer_pattern=M*M-MQ"])
    assert r.rc == 2 and "model.hybrid_layer_pattern='M*M-MQ' has the unknown symbol(s) 'Q'" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_without_triton_a_hybrid_model_is_refused_in_one_line_and_a_dense_one_validates(tmp_path):
    """Where triton is not installed (a CPU-only or offline install), Megatron-Core 0.16's Mamba mixer cannot be
    imported: a hybrid model is refused naming it (exit 2, no traceback), a dense model still validates."""
    import os
    import subprocess
    import sys

    blocker = tmp_path / "triton"
    blocker.mkdir()
    (blocker / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'triton\'", name="triton")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    runs = {name: subprocess.run([sys.executable, "-m", "pretrain", "validate", name, "data.mock=true"], env=env,
                                 capture_output=True, text=True, timeout=300) for name in (CONFIG, "tiny_llama")}
    hybrid, dense = runs[CONFIG], runs["tiny_llama"]
    assert hybrid.returncode == 2 and "Traceback" not in hybrid.stdout + hybrid.stderr, hybrid.stdout + hybrid.stderr
    assert "Mamba-2 layers (model.hybrid_layer_pattern) are built from Megatron-Core's megatron.core.ssm, which " \
           "imports `triton`: it is not installed here" in hybrid.stderr, hybrid.stderr
    assert dense.returncode == 0 and "config OK" in dense.stdout, dense.stdout + dense.stderr


# Megatron-Bridge's published Nemotron 3 Nano runs (performance summary, 26.04.01 container, sequence 8192): model
# TFLOP/s per GPU and tokens/s per GPU on GB300, GB200, B300, B200 (8 GPUs, EP8) and H100 (16 GPUs).
NANO_PUBLISHED = {"gb300": (845, 37888), "gb200": (725, 32768), "b300": (794, 35840), "b200": (726, 32768),
                  "h100": (321, 14336)}


def test_published_nano_layout_validates_and_plans():
    """launch/pretrain_nemotron3_nano.sh as `validate --world-size 8` checks it (a GPU dry run): Megatron-Bridge's
    layout (TP1, EP8, DP8, GBS 512 × 8192) is accepted; `plan` counts the HF model's parameters and Megatron's
    FLOPs per token, inside the range the published runs give (TFLOP/s ÷ tokens/s)."""
    from pretrain.layout import derive_layout
    from pretrain.plan import count_parameters
    from pretrain.planner import make_plan
    from tests.pretrain.test_placement_config import _launch_overrides

    config, overrides = _launch_overrides("pretrain_nemotron3_nano.sh", {})
    cfg = load_config(config, [*overrides, "data.mock=true"])
    report = validate(cfg, 8, gpu_dry_run=True, cuda_available=False)
    assert report.ok, report.text()
    lay = derive_layout(cfg, 8, vocab_size=cfg.model.vocab_size)
    assert (lay.tp, lay.pp, lay.cp, lay.ep, lay.etp, lay.dp) == (1, 1, 1, 8, 1, 8)
    assert cfg.train.global_batch_size == 512 and cfg.model.seq_length == 8192
    assert count_parameters(cfg, 131072) == 31_577_937_344  # NemotronHForCausalLM(the released config) on meta
    plan = make_plan(cfg, nodes=1, gpus_per_node=8, gpu="b200")
    published = [tflops * 1e12 / tokens for tflops, tokens in NANO_PUBLISHED.values()]
    print(f"nemotron3_nano: planner {plan['flops_per_token']:.4e} FLOPs/token; published "
          f"{min(published):.4e} .. {max(published):.4e}")
    assert min(published) <= plan["flops_per_token"] <= max(published)


def test_super_preset_counts_as_transformers_and_validates_on_gpus():
    """nemotron3_super (LatentMoE, no MTP here): the planner's count equals transformers' NemotronHForCausalLM of the
    same config (built on the meta device; it builds no MTP layer either); Megatron-Bridge's GB300 layout (64 GPUs,
    TP1, EP64, GBS 512 × 8192) validates as a GPU job; on this machine the latent projections (Transformer Engine
    only) are refused naming the key."""
    import torch
    from transformers import AutoModelForCausalLM

    from model_providers import get_family
    from pretrain.plan import count_parameters

    layout = ["data.mock=true", "parallel.expert=64", "parallel.expert_tensor=1", "train.global_batch_size=512",
              "model.seq_length=8192", "optimizer.distributed=true"]
    cfg = load_config(None, ["model.preset=nemotron3_super", *layout])
    hf_cfg = get_family("nemotron_h").to_hf_config(cfg.model, 131072, bos=None, eos=None, dtype=torch.bfloat16)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_cfg).parameters())
    assert count_parameters(cfg, 131072) == theirs == 120_668_687_360
    assert validate(cfg, 64, gpu_dry_run=True, cuda_available=False).ok
    here = validate(cfg, 64, files=False)
    assert any(p.keys == ("model.moe_latent_size", "model.transformer_impl") for p in here.errors), here.text()


def test_transformer_engine_stack_spec_takes_the_cpu_mixer_without_mamba_ssm():
    """On GPUs with Transformer Engine the hybrid stack is Megatron-Core's own spec with our mixer arguments; where
    `mamba_ssm` is not installed (here) its mixer is `CpuMambaMixer`; Megatron-Core's module-level spec is left as
    it was."""
    from megatron.core.models.mamba import mamba_layer_specs

    from model_providers.core.mamba_builder import te_stack_spec
    from model_providers.core.mamba_mixer import CpuMambaMixer

    original = getattr(mamba_layer_specs, "mamba_stack_spec", None) or mamba_layer_specs.hybrid_stack_spec
    mixer = te_stack_spec(load_config(CONFIG).model).submodules.mamba_layer.submodules.mixer
    assert mixer.module is CpuMambaMixer and mixer.params["chunk_size"] == 8 and mixer.params["d_conv"] == 4
    assert original.submodules.mamba_layer.submodules.mixer.module is not CpuMambaMixer
