"""MoE config, derived expert layout and validation (fast, in-process): presets match the public shapes,
every expert-parallel rule reports its exact one-line message, and all problems come at once."""

from __future__ import annotations

import pytest

from pretrain.config import CONFIG_DIR, load_config
from pretrain.layout import derive_layout
from pretrain.validate import validate
from tests.cli import run_cli

REPO = CONFIG_DIR.parent.parent


def problems(overrides: list[str], world: int, config: str = "tiny_moe", **kw) -> list[str]:
    return [str(p) for p in validate(load_config(config, overrides), world, **kw).errors]


def test_tiny_moe_config_and_presets():
    m = load_config("tiny_moe").model
    assert (m.family, m.num_moe_experts, m.moe_router_topk, m.moe_expert_capacity_factor) == ("mixtral", 8, 2, None)
    assert m.moe_aux_loss_coeff == 0.02 and m.moe_token_dispatcher_type == "alltoall"
    mixtral = load_config(None, ["model.preset=mixtral_8x7b"]).model
    assert (mixtral.num_layers, mixtral.hidden_size, mixtral.ffn_hidden_size, mixtral.num_moe_experts,
            mixtral.moe_router_topk, mixtral.num_query_groups, mixtral.vocab_size) == (32, 4096, 14336, 8, 2, 8, 32000)
    qwen = load_config(None, ["model.preset=qwen3_30b_a3b"]).model
    assert (qwen.num_layers, qwen.hidden_size, qwen.kv_channels, qwen.num_moe_experts, qwen.moe_router_topk,
            qwen.moe_ffn_hidden_size, qwen.qk_layernorm, qwen.num_query_groups) == (48, 2048, 128, 128, 8, 768, True, 4)
    big = load_config(None, ["model.preset=qwen3_235b_a22b"]).model
    assert (big.num_layers, big.hidden_size, big.num_attention_heads, big.moe_ffn_hidden_size) == (94, 4096, 64, 1536)


def test_expert_layout_folds_into_tensor_and_data_parallel():
    cfg = load_config("tiny_moe", ["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.pipeline=2",
                                   "parallel.expert=2", "parallel.expert_tensor=1"])
    lay = derive_layout(cfg, 4, vocab_size=32000, on_gpu=False)
    assert (lay.tp, lay.pp, lay.dp, lay.ep, lay.etp, lay.edp, lay.moe) == (2, 2, 1, 2, 1, 1, True)
    assert lay.describe() == "TP2 × PP2 × CP1 × DP1; experts ETP1 × EP2 × EDP1"
    lay = derive_layout(load_config("tiny_moe", ["parallel.expert=2"]), 8, vocab_size=32000, on_gpu=False)
    assert (lay.dp, lay.ep, lay.etp, lay.edp) == (8, 2, 1, 4)
    dense = derive_layout(load_config("tiny_llama"), 2, vocab_size=32000, on_gpu=False)
    assert not dense.moe and (dense.ep, dense.etp, dense.edp) == (1, 1, 2)


CASES = [
    (["parallel.expert=3"], 3,
     "[model.num_moe_experts, parallel.expert] model.num_moe_experts=8 is not divisible by parallel.expert=3. "
     "Fix: choose parallel.expert from 1, 2, 4, 8"),
    (["parallel.expert=4"], 2,
     "[parallel.expert_tensor, parallel.expert, parallel.pipeline] world size 2 is not divisible by "
     "expert_tensor×expert×pipeline = 1×4×1 = 4. Fix: launch a multiple of 4 processes, or choose "
     "parallel.expert_tensor×parallel.expert (now 1×4 = 4) dividing 2 (world size 2 / parallel.pipeline=1: the ranks "
     "of one pipeline stage, over which its experts are split)"),
    (["parallel.tensor=2"], 2,
     "[parallel.sequence_parallel, parallel.tensor, model.num_moe_experts] MoE with parallel.tensor > 1 needs "
     "sequence parallelism (Megatron-Core refuses to train without it). Fix: set parallel.sequence_parallel=true"),
    (["model.moe_router_topk=9"], 1,
     "[model.moe_router_topk, model.num_moe_experts] model.moe_router_topk=9 is more than model.num_moe_experts=8. "
     "Fix: choose moe_router_topk from 1 to 8"),
    (["model.moe_ffn_hidden_size=130", "parallel.expert_tensor=4", "parallel.expert=2"], 8,
     "[model.moe_ffn_hidden_size, parallel.expert_tensor] model.moe_ffn_hidden_size=130 is not divisible by "
     "expert tensor parallel 4. Fix: choose parallel.expert_tensor from 1, 2, 5, 10, 13, 26, 65, 130"),
    (["model.moe_expert_capacity_factor=0"], 1,
     "[model.moe_expert_capacity_factor] model.moe_expert_capacity_factor=0 must be a finite number above 0. Fix: "
     "set model.moe_expert_capacity_factor to a finite number above 0, or null"),
    (["model.moe_pad_expert_input_to_capacity=true"], 1,
     "[model.moe_pad_expert_input_to_capacity, model.moe_expert_capacity_factor] padding expert inputs to "
     "capacity needs a capacity factor. Fix: set model.moe_expert_capacity_factor or "
     "model.moe_pad_expert_input_to_capacity=false"),
    (["model.moe_aux_loss_coeff=-0.1"], 1,
     "[model.moe_aux_loss_coeff] model.moe_aux_loss_coeff=-0.1 must be a finite number, 0 or more. Fix: set "
     "model.moe_aux_loss_coeff to a finite number, 0 or more (default 0.0)"),
    (["model.moe_grouped_gemm=true"], 1,
     "[model.moe_grouped_gemm, model.transformer_impl] model.moe_grouped_gemm=true needs the Transformer Engine "
     "spec (the local spec runs experts one after another). Fix: set model.moe_grouped_gemm=null, or run on a "
     "GPU with transformer-engine"),
    (["parallel.expert=0"], 1,
     "[parallel.expert] parallel.expert=0 must be at least 1. Fix: set parallel.expert to a positive integer "
     "(default 1)"),
]


@pytest.mark.parametrize("overrides,world,message", CASES, ids=[";".join(c[0]) for c in CASES])
def test_each_moe_rule_reports_exact_message(overrides, world, message):
    got = problems(overrides, world, te_on_gpu=False, cuda_available=False)
    assert message in got, got


def test_expert_parallel_on_a_dense_model_is_refused():
    got = problems(["parallel.expert=2"], 2, config="tiny_llama")
    assert got == ["[parallel.expert, model.num_moe_experts] parallel.expert is set but the model has no experts "
                   "(model.num_moe_experts is null). Fix: set model.num_moe_experts or remove parallel.expert"]


def test_valid_moe_layouts_and_all_problems_at_once():
    ok = [(["parallel.expert=2"], 2), (["parallel.expert=8", "train.global_batch_size=16"], 8),
          (["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2", "parallel.expert_tensor=1",
            "parallel.pipeline=2"], 4),
          (["parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=4"], 8)]
    for overrides, world in ok:
        assert problems(overrides, world) == [], overrides
    got = problems(["parallel.expert=3", "parallel.tensor=2", "model.moe_router_topk=9"], 4)
    assert len(got) == 4, got
    assert [p.split("]")[0] + "]" for p in got] == [
        "[model.num_moe_experts, parallel.expert]", "[parallel.expert_tensor, parallel.expert, parallel.pipeline]",
        "[model.moe_router_topk, model.num_moe_experts]",
        "[parallel.sequence_parallel, parallel.tensor, model.num_moe_experts]"]


def test_cli_validates_the_production_moe_layout():
    r = run_cli("pretrain", ["validate", "tiny_moe", "model.preset=qwen3_30b_a3b", "parallel.expert=3",
                             "--world-size", "16"], cwd=REPO)
    assert r.rc == 2 and "model.num_moe_experts=128 is not divisible by parallel.expert=3" in r.stderr
