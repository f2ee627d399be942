"""Pipeline placement without training: `Layout.chunk_layers` for `parallel.pipeline_layout` and the embedding / loss
counted in the split equals Megatron-Core's own offsets and layer counts; `validate` refuses what Megatron-Core
refuses with one line naming the key; the shipped configs and launch scripts of the published layouts
(Llama-3.1-405B, Qwen3-235B-A22B, DeepSeek-V3 PP8 VP2 / PP8 VP4) validate on mock data at their world sizes and
print their placement; the planner sizes every stage of an explicit placement."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from pretrain.config import load_config
from pretrain.layout import derive_layout
from pretrain.validate import validate
from tests.pretrain.ckpt_helpers import REPO
from tests.pretrain.megatron_oracle import megatron_chunks

pytestmark = pytest.mark.mcore

# (num_layers, mtp layers, PP, VP, pipeline_layout or None, embedding in split, loss in split)
PLACEMENTS = [
    (6, None, 4, 1, "Et|ttt|t|tL", False, False),
    (6, None, 2, 2, "Ett|t|tt|tL", False, False),
    (4, 1, 2, 2, "Et|t|t|tmL", False, False),
    (61, 1, 8, 2, "Et*4|(t*4|)*14tmL", False, False),  # DeepSeek-V3, B200 × 256
    (61, 1, 8, 4, "Et|(tt|)*30mL", False, False),  # DeepSeek-V3, H100 × 1024
    (126, None, 8, 8, None, True, True),  # Llama-3.1-405B
    (94, None, 8, 4, None, True, True),  # Qwen3-235B-A22B, H100
    (94, None, 8, 2, None, True, True),  # Qwen3-235B-A22B, B200
    (7, None, 2, 1, None, True, False),
    (7, None, 2, 1, None, False, True),
]


@pytest.mark.parametrize("layers,mtp,pp,vp,layout,emb,loss", PLACEMENTS)
def test_placement_is_megatron_cores(layers, mtp, pp, vp, layout, emb, loss):
    """Every chunk's (first decoder layer, decoder layers) and the MTP chunk, against Megatron-Core's functions."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=1, pipeline_dtype=torch.float32,
                           pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                           pipeline_model_parallel_layout=layout, mtp_num_layers=mtp,
                           account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
    overrides = ["data.mock=true", f"model.num_layers={layers}", f"parallel.pipeline={pp}",
                 f"parallel.virtual_pipeline={vp if vp > 1 else 'null'}",
                 f"parallel.pipeline_layout={layout if layout else 'null'}",
                 f"parallel.account_for_embedding_in_pipeline_split={str(emb).lower()}",
                 f"parallel.account_for_loss_in_pipeline_split={str(loss).lower()}"]
    lay = derive_layout(load_config("tiny_llama", overrides), pp, vocab_size=32000, on_gpu=False, te=False)
    chunks = megatron_chunks(tc, pp, vp)
    for (rank, stage), (first, count, _) in chunks.items():
        assert lay.chunk_layers(layers, rank, stage) == (first, count), (rank, stage)
    total = sum(count for _, count, _ in chunks.values())
    mtp_at = [chunk for chunk, (_, _, builds_mtp) in chunks.items() if builds_mtp]
    assert total == layers
    assert mtp_at == ([lay.mtp_chunk] if mtp else [])


def _problems(overrides: list[str], world: int, config: str = "tiny_llama") -> list[str]:
    cfg = load_config(config, ["data.mock=true", *overrides])
    return [str(p) for p in validate(cfg, world, cuda_available=False, files=False).errors]


REFUSALS = [
    (["parallel.pipeline=2", "parallel.pipeline_layout=Ett|tttL"], "Number of decoder layers 5"),
    (["parallel.pipeline=2", "parallel.pipeline_layout=Et|t|t|tL"], "set parallel.virtual_pipeline=2"),
    (["parallel.pipeline=2", "parallel.pipeline_layout=Ett|ttL", "parallel.num_layers_in_first_pipeline_stage=2"],
     "cannot be combined with parallel.num_layers_in_first_pipeline_stage"),
    (["parallel.pipeline=2", "parallel.pipeline_layout=Ett|tx|L"], "Invalid layer character: x"),
    (["parallel.pipeline=2", "parallel.account_for_embedding_in_pipeline_split=true"],
     "model.num_layers=4 + 1 (embedding / loss counted as layers) = 5 is not divisible by pipeline stages 2"),
    (["parallel.pipeline=2", "parallel.account_for_loss_in_pipeline_split=true",
      "parallel.num_layers_in_last_pipeline_stage=1"], "cannot be combined with"),
]


@pytest.mark.parametrize("overrides,message", REFUSALS)
def test_validate_refuses_what_megatron_core_refuses(overrides, message):
    problems = _problems(overrides, 2)
    assert len(problems) == 1 and message in problems[0], problems


def test_mtp_on_another_rank_is_refused():
    problems = _problems(["parallel.pipeline=3", "parallel.pipeline_layout=Ett|ttm|L"], 3, "tiny_deepseek")
    assert len(problems) == 1 and "mtp_standalone" in problems[0], problems


def _launch_overrides(script: str, env: dict) -> tuple[str, list[str]]:
    out = subprocess.run(["bash", f"launch/{script}"], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, **env, "LAUNCH_PRINT_OVERRIDES": "1"}).stdout.split()
    return out[0], out[1:]


# (script, environment, world size, the placement note's last row)
PUBLISHED = [
    ("pretrain_405b.sh", {}, 1024, "decoder,loss"),
    ("pretrain_405b.sh", {"GPU": "b200"}, 128, "decoder,loss"),
    ("pretrain_235b.sh", {}, 256, "decoder*2,loss"),
    ("pretrain_235b.sh", {"GPU": "b200"}, 64, "decoder*5,loss"),
    ("pretrain_deepseek_v3.sh", {}, 256, "decoder,mtp,loss"),
    ("pretrain_deepseek_v3.sh", {"LAYOUT": "h100"}, 1024, "mtp,loss"),
    ("pretrain_kimi_k2.sh", {}, 512, "decoder,loss"),  # with Muon (MuonClip), as published
    ("pretrain_kimi_k2.sh", {"OPTIMIZER": "adamw"}, 512, "decoder,loss"),
]


@pytest.mark.parametrize("script,env,world,last", PUBLISHED)
def test_published_layouts_validate_on_mock_data(script, env, world, last):
    """What the launch script runs, checked as `validate --world-size N` checks it (a GPU dry run), on mock data;
    then every pipeline stage's decoder and MTP block specs are built (on the local spec: FP8 and the performance
    settings need Transformer Engine), as each rank builds them (DeepSeek-V3's H100 layout ends in a stage holding
    only the MTP layer and the loss)."""
    from tests.pretrain.test_feature_combinations import build_megatron_configs

    config, overrides = _launch_overrides(script, env)
    cfg = load_config(config, [*overrides, "data.mock=true"])
    report = validate(cfg, world, gpu_dry_run=True, cuda_available=False)
    assert report.ok, report.text()
    note = next(n for n in report.notes if n.startswith("pipeline placement"))
    assert note.splitlines()[-1].split()[-1] == last, note
    on_cpu = [o for o in overrides if not o.startswith(("model.fp8", "performance."))]
    build_megatron_configs(load_config(config, [*on_cpu, "data.mock=true"]), world)


def test_planner_sizes_every_stage_of_a_layout():
    """DeepSeek-V3 on PP8 × VP2 (B200): all 8 stages sized, the per-stage FLOPs add up to the model's, the last
    stage's output and MTP layers; the even split keeps its first / last stage view."""
    from pretrain.observe.flops import flops_per_token
    from pretrain.planner.plan import make_plan

    config, overrides = _launch_overrides("pretrain_deepseek_v3.sh", {})
    plan = make_plan(load_config(config, [*overrides, "data.mock=true"]), 32, 8, "b200", 0.4)
    assert [s["pipeline_stage"] for s in plan["stages"]] == list(range(8))
    flops = plan["stage_flops_per_token"]
    assert abs(sum(flops) - plan["flops_per_token"]) <= 1e-9 * plan["flops_per_token"]
    assert flops[-1] > max(flops[1:-1])  # 9 decoder layers but the output layer and the MTP layer
    even = make_plan(load_config("llama3_70b", ["data.mock=true"]), 8, 8, "h100", 0.4)
    assert [s["pipeline_stage"] for s in even["stages"]] == [0, 7]
    assert flops_per_token(load_config("deepseek_v3").model, plan["padded_vocab_size"]) == plan["flops_per_token"]
    assert plan["most_loaded_rank"]["pipeline_stage"] == 1  # dense layers 0-2 on stage 0: MoE stage 1 is larger


def test_search_tries_placements_where_layers_do_not_divide_the_stages():
    """`plan --search` places layers that do not divide the virtual stages as Megatron-Bridge does: DeepSeek-V3's
    layout strings on PP8 × VP2 and VP4, the embedding and loss in the split for Llama-3.1-405B (126 layers on 8 × 8);
    a 7-layer model on 4 GPUs is planned with uneven first / last stages on PP4 and a layout string on PP2 × VP2 (no
    first / last split places 7 layers on 4 virtual stages)."""
    from pretrain.planner.placements import Placement, layout_string, placements
    from pretrain.planner.search import search

    assert layout_string(61, 16, mtp=True) == "Et*4|(t*4|)*14tmL"
    assert layout_string(61, 32, mtp=True) == "Et|(tt|)*30mL"
    assert Placement(embedding_and_loss=True) in placements(126, 8, 8, False, None)
    found = search(load_config("tiny_llama", ["data.mock=true", "model.num_layers=7"]), 1, 4, "h100", top=0)
    placed = {(r["pipeline"], r["virtual_pipeline"], r["placement"]) for r in found if r["pipeline"] > 1}
    assert (2, 2, "parallel.pipeline_layout=Ett|(tt|)*2tL") in placed, placed
    assert any(pp == 4 and p and p.startswith("parallel.num_layers_in_first") for pp, _, p in placed), placed
