"""The `performance` section (`pretrain/performance.py`): refused by `validate` on a machine without CUDA, naming what
each setting needs; accepted as a GPU dry run (`--world-size N`); passed to Megatron-Core's TransformerConfig under its
own names (both supported releases); counted by the planner where it changes time."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from pretrain import plan
from pretrain.config import load_config
from tests.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
ALL = ["performance.moe_flex_dispatcher_backend=deepep", "performance.cuda_graph_impl=transformer_engine",
       "performance.cuda_graph_scope=[attn,moe_router]", "performance.fine_grained_activation_offloading=true",
       "performance.offload_modules=[core_attn,expert_fc1]", "performance.overlap_moe_expert_parallel_comm=true",
       "performance.fp4_recipe=nvfp4", "performance.cross_entropy_fusion_impl=te"]
SUPER_NVFP4 = REPO / "benchmarks" / "quant_recipes" / "nemotron_3_super_nvfp4.yaml"
MOE = ["tiny_moe", "data.mock=true", "parallel.expert=2", "train.precision=bf16", "train.global_batch_size=16"]


def test_refused_on_cpu_with_the_reason_and_accepted_as_a_gpu_dry_run():
    here = run_cli("pretrain", ["validate", *MOE, *ALL], cwd=REPO)
    assert here.rc == 2 and here.traceback is None
    out = here.stdout + here.stderr
    flex = "performance.moe_flex_dispatcher_backend"
    assert f"[{flex}] {flex} needs a GPU and DeepEP" in out
    assert "[performance.fp4_recipe] performance.fp4_recipe needs Transformer Engine on a Blackwell GPU" in out
    for key in ALL:
        assert f"[{key.split('=')[0]}]" in out, key
    dry = run_cli("pretrain", ["validate", *MOE, *ALL, "--world-size", "2"], cwd=REPO)
    assert dry.rc == 0, dry.stdout + dry.stderr
    assert "not on this machine (no CUDA, no Transformer Engine): [performance.cuda_graph_impl]" in dry.stdout


@pytest.mark.full
def test_refused_on_gpus_where_the_model_gives_it_nothing_to_do():
    """What the model gives a setting nothing to do, or a half-set pair, is refused on GPUs too."""
    dense = run_cli("pretrain", ["validate", "tiny_llama", "data.mock=true", "model.vocab_size=32000",
                                 "performance.moe_flex_dispatcher_backend=hybridep",
                                 "performance.fine_grained_activation_offloading=true", "--world-size", "2"], cwd=REPO)
    assert dense.rc == 2
    assert "the model has no experts (model.num_moe_experts)" in dense.stderr
    assert "needs both performance.fine_grained_activation_offloading=true and the submodules" in dense.stderr


@pytest.mark.mcore
def test_passed_to_megatron_core_transformer_config():
    from pretrain import compat
    from pretrain.layout import derive_layout

    compat.import_megatron(False)
    from model_providers.core.builder import transformer_config
    from model_providers.core.model_plan import model_plan

    cfg = load_config("tiny_moe", ["data.mock=true", "parallel.expert=2", *ALL[:5], *ALL[6:]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = transformer_config(model_plan(cfg), derive_layout(cfg, 2, on_gpu=False, te=False))
    assert (tc.moe_token_dispatcher_type, tc.moe_flex_dispatcher_backend) == ("flex", "deepep")
    assert tc.cuda_graph_impl == "transformer_engine"
    assert tc.fine_grained_activation_offloading and list(tc.offload_modules) == ["core_attn", "expert_fc1"]
    assert (tc.fp4, tc.fp4_recipe) == ("e2m1", "nvfp4")
    assert tc.cross_entropy_fusion_impl == "te"
    assert not tc.first_last_layers_bf16 and tc.quant_recipe is None
    kept = load_config("tiny_moe", ["data.mock=true", "performance.fp4_recipe=nvfp4", f"performance.quant_recipe="
                                    f"{SUPER_NVFP4}", "performance.num_layers_at_end_in_bf16=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = transformer_config(model_plan(kept), derive_layout(kept, 1, on_gpu=False, te=False))
    assert (tc.first_last_layers_bf16, tc.num_layers_at_start_in_bf16, tc.num_layers_at_end_in_bf16) == (True, 0, 1)
    assert [m.pattern for m in tc.quant_recipe.matchers] == ["*.linear_qkv", "*.linear_proj", "*mlp.fc[12]_latent_proj",
                                                             "mtp.*", "*mixer.out_proj"]
    offload = load_config("tiny_moe", ["data.mock=true", "performance.cpu_offloading_num_layers=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tc = transformer_config(model_plan(offload), derive_layout(offload, 1, on_gpu=False, te=False))
    assert (tc.cpu_offloading, tc.cpu_offloading_num_layers, tc.cpu_offloading_weights) == (True, 1, False)


def test_the_planner_counts_them():
    """Qwen3-30B-A3B, EP16 over 2 nodes of H100 (micro batch 1, 64 microbatches): DeepEP sends one copy per destination
    node over the network (and every copy over NVLink), the A2A overlap hides the all-to-all behind another
    microbatch's compute but for the first forward and last backward and slows that compute by the SMs the
    communication holds, CUDA graphs shrink the host's launch time."""
    from pretrain.planner.constants import value

    base = ["model.fp8=tensorwise", "parallel.pipeline=1", "parallel.expert=16", "train.global_batch_size=1024"]

    def cost(*extra: str) -> dict:
        return plan.make_plan(load_config("qwen3_30b_a3b", [*base, *extra]), 2, 8, "h100")["cost_model"]

    plain = cost()
    deepep = cost("performance.moe_flex_dispatcher_backend=deepep")
    overlap = cost("performance.overlap_moe_expert_parallel_comm=true")
    graphs = cost("performance.cuda_graph_impl=transformer_engine")
    # Per MoE layer and microbatch: 4096 tokens, top-8, hidden 2048, bf16, dispatch + combine forward and backward.
    per_copy, layers, microbatches = 4 * 4096 * 2048 * 2, 48, 64
    nv, net = 450e9 * value("nvlink_a2a_efficiency"), 50e9 * value("network_efficiency")
    # 8 of 16 experts on the other node: 4 of 8 copies leave it (the other 4 and 3.5 of the rest over NVLink)...
    plain_s = max(per_copy * 8 * (15 / 16 - 0.5) / nv, per_copy * 4 / net)
    assert plain["ep_comm_s"] == pytest.approx(layers * microbatches * plain_s, rel=1e-6)
    # ... DeepEP sends 1 − (1/2)^8 of one per token there, every copy crossing NVLink once.
    deepep_s = max(per_copy * 8 * 15 / 16 / nv, per_copy * (1 - 0.5 ** 8) / net)
    assert deepep["ep_comm_s"] == pytest.approx(layers * microbatches * deepep_s, rel=1e-6)
    comm, comp = plain["ep_comm_s"] * (1 - 1 / 64), plain["compute_s"] * (1 - 1 / 64)
    f = 32 / 132  # NCCL's all-to-all thread blocks of the H100's 132 SMs
    expected = plain["ep_comm_s"] / 64 + max(0.0, comm - comp) + min(comm, comp) * f / (1 - f)
    assert overlap["ep_exposed_s"] == pytest.approx(expected, rel=1e-6)
    assert graphs["host_s"] == pytest.approx(plain["host_s"] * value("launch_us_cuda_graphs") / value("launch_us"))
    print(f"step s: plain {plain['step_s']:.1f}, DeepEP {deepep['step_s']:.1f}, A2A overlap {overlap['step_s']:.1f}, "
          f"CUDA graphs {graphs['step_s']:.1f}")


def test_bf16_layers_and_a_quantization_recipe_checked_and_planned(tmp_path):
    """performance.num_layers_at_{start,end}_in_bf16 and performance.quant_recipe: refused without an FP8 / NVFP4
    recipe, past one pipeline stage's layers, or with a malformed recipe file (one line naming it, exit 2, no
    traceback); planned per GEMM: k of L identical layers in BF16 move the GEMM time k/L of the way from the NVFP4 run
    to the BF16 run; a recipe sending every module to BF16 (or MXFP8) plans the BF16 (MXFP8) run's GEMMs; a matcher that
    does not override the quantized context changes nothing."""
    gpu = ["--world-size", "2"]
    bad = tmp_path / "recipe.yaml"
    bad.write_text("configs: {q: {transformer_engine_config_type: TEQuantizationParams, training_recipe: "
                   "{fp8_quantization_recipe: delayed}}}\nmatchers: {all: {config: q, type: glob, pattern: '*', "
                   "enabled: true}}\n")
    out = run_cli("pretrain", ["validate", "tiny_llama", "data.mock=true", "performance.num_layers_at_end_in_bf16=9",
                               "parallel.pipeline=2", "model.fp8=tensorwise", f"performance.quant_recipe={bad}", *gpu],
                  cwd=REPO)
    assert out.rc == 2 and out.traceback is None, out.stdout + out.stderr
    assert "performance.num_layers_at_end_in_bf16=9 is more than one pipeline stage's" in out.stderr, out.stderr
    assert f"performance.quant_recipe: {bad}: config 'q': fp8_quantization_recipe 'delayed' is not one of" in out.stderr
    none = run_cli("pretrain", ["validate", "tiny_llama", "data.mock=true", "performance.num_layers_at_start_in_bf16=1",
                                *gpu], cwd=REPO)
    assert none.rc == 2 and "chooses GEMMs to keep out of an FP8 or NVFP4 recipe, and this run has none" in none.stderr

    def gemm_s(*extra: str) -> float:
        cfg = load_config("llama3_8b", ["parallel.pipeline=1", "parallel.tensor=1", "train.global_batch_size=64",
                                        *extra])
        return plan.make_plan(cfg, 1, 8, "b200")["cost_model"]["gemm_s"]

    nvfp4, bf16 = gemm_s("performance.fp4_recipe=nvfp4"), gemm_s()
    kept = gemm_s("performance.fp4_recipe=nvfp4", "performance.num_layers_at_start_in_bf16=2",
                  "performance.num_layers_at_end_in_bf16=6")
    assert kept == pytest.approx(nvfp4 + 8 / 32 * (bf16 - nvfp4), rel=1e-9)
    assert bf16 > kept > nvfp4

    def recipe(name: str, training: str) -> str:
        f = tmp_path / f"{name}.yaml"
        f.write_text(f"configs: {{c: {{transformer_engine_config_type: TEQuantizationParams, training_recipe: "
                     f"{training}}}}}\nmatchers: {{all: {{config: c, type: glob, pattern: '*', enabled: true}}}}\n")
        return f"performance.quant_recipe={f}"

    assert gemm_s("performance.fp4_recipe=nvfp4", recipe("bf16", "{}")) == pytest.approx(bf16, rel=1e-12)
    mxfp8 = gemm_s("model.fp8=mxfp8")
    assert gemm_s("performance.fp4_recipe=nvfp4", recipe("mx", "{fp8_quantization_recipe: mxfp8}")) == \
        pytest.approx(mxfp8, rel=1e-12)
    assert gemm_s("performance.fp4_recipe=nvfp4", recipe("keep", "{override_quantized_autocast: false}")) == \
        pytest.approx(nvfp4, rel=1e-12)
