"""Bad input and path changes through the CLI, in one worker process (tests/pretrain/cli_failures_worker.py):

- blend weights: 0 (Megatron-Core's `BlendedDataset` asserts every weight > 0), YAML 1.1 strings (`1e300`),
  non-finite or negligible ones: one line from `validate`, never a bare `AssertionError` in training;
- Megatron-Core's own `TransformerConfig` checks run in `validate` (a MoE top-1 softmax router without
  pre-softmax passed it and then failed in the trainer), and an exception nobody expected still leaves
  `exit_status.json` saying `failed` with its one-line summary;
- path keys changed on a resume (`checkpoint.dir`, `data.cache_dir`, `checkpoint.pretrained`): the run continues
  from its newest complete checkpoint wherever this run dir saved it, every change said in one line, no
  `metrics.jsonl` line lost; `train.steps` below the resumed step says there is nothing to train;
- smaller ones: a null `model.vocab_size` over a preset that sets one, `parallel.context=0` without knock-ons,
  FSDP with the distributed optimizer, a file as `data.cache_dir`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import log_text

pytestmark = pytest.mark.slow

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.ffn_hidden_size=128", "model.seq_length=32", "train.global_batch_size=2", "train.micro_batch_size=2",
        "logging.tensorboard=false", "optimizer.warmup_steps=0"]
MOE_TOP1 = ["model.num_moe_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_router_topk=1"]


@pytest.fixture(scope="module")
def results(small_datasets, tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    a, b = small_datasets["a"], small_datasets["b"]
    (root / "afile").write_text("not a directory")
    run_dir, train = root / "run", ["train", "tiny_llama", *TINY, "model.vocab_size=4096", "checkpoint.interval=2"]
    validate = ["validate", "tiny_llama"]
    cases = [
        {"name": "blend_zero", "argv": [*validate, f"data.blend=[0,{a},1,{b}]"]},
        {"name": "blend_zero_train", "argv": ["train", "tiny_llama", *TINY, f"run.dir={root}/zero",
                                              f"data.blend=[0.7,{b},0.0,{a}]"]},
        {"name": "blend_strings", "argv": [*validate, f"data.blend=[1e3,{a},4.2e9,{b}]"]},
        {"name": "blend_negligible", "argv": [*validate, f"data.blend=[1e300,{a},4.2e9,{b}]"]},
        {"name": "blend_inf", "argv": [*validate, f"data.blend=[inf,{a},1,{b}]"]},
        {"name": "tc_assert", "argv": [*validate, *MOE_TOP1]},
        # The same config with Megatron-Core's checks switched off in validate: the trainer's TransformerConfig
        # raises after run.dir is marked running; exit_status.json must say failed.
        {"name": "unexpected", "setup": [["noop", "pretrain.validate:megatron_config_rules"]],
         "argv": [*train, *MOE_TOP1, f"run.dir={root}/unexpected", "train.steps=1"]},
        {"name": "vocab_null", "argv": [*validate, "model.preset=llama32_1b", "model.vocab_size=null",
                                        "data.tokenizer_type=huggingface"]},
        {"name": "context_0", "argv": [*validate, "parallel.context=0"]},
        {"name": "fsdp_distributed", "argv": [*validate, "optimizer.fsdp=true", "optimizer.distributed=true",
                                              "--world-size", "2"]},
        {"name": "cache_dir_file", "argv": [*validate, f"data.cache_dir={root}/afile"]},
        # Path keys on a resume: 2 steps; 3 with checkpoint.dir, data.cache_dir and checkpoint.pretrained changed;
        # back to the default checkpoint.dir with train.steps=2, below the step saved in the other root.
        {"name": "base", "argv": [*train, f"run.dir={run_dir}", "train.steps=2"]},
        {"name": "moved", "argv": [*train, f"run.dir={run_dir}", "train.steps=3", f"checkpoint.dir={root}/new",
                                   f"data.cache_dir={root}/cache2",
                                   f"checkpoint.pretrained={run_dir}/checkpoints/iter_0000002"]},
        {"name": "back", "argv": [*train, f"run.dir={run_dir}", "train.steps=2"]},
    ]
    plan = root / "plan.json"
    plan.write_text(json.dumps({"results": str(root / "results.json"), "cases": cases}))
    log = root / "worker.log"
    assert run_case(1, "tests.pretrain.cli_failures_worker", [str(plan)], log, timeout=600) == 0, \
        log_text(log)[-4000:]
    return root, json.loads((root / "results.json").read_text())


def _refused(result: dict, rc: int = 2) -> str:
    """The one problem line of a refusal (exit `rc`, no traceback)."""
    assert result["escaped"] is None and "Traceback" not in result["stderr"], result
    assert result["rc"] == rc, result
    problems = [ln for ln in result["stderr"].splitlines() if ln.startswith("  1. ")]
    assert len(problems) == 1 and "  2. " not in result["stderr"], result["stderr"]
    return problems[0]


def test_blend_weights(results):
    root, r = results
    line = _refused(r["blend_zero"])
    assert "[data.blend] data.blend weight 0 of " in line and "every weight must be positive" in line, line
    assert "remove the entry to leave that dataset out" in line
    assert "weight 0.0 of " in _refused(r["blend_zero_train"])
    assert not (root / "zero" / "exit_status.json").exists()  # refused before the run dir is marked running
    assert r["blend_strings"]["rc"] == 0, r["blend_strings"]  # YAML 1.1 strings read as the numbers they are
    assert "is 4.2e-291 of the total: that dataset would never be drawn" in _refused(r["blend_negligible"])
    assert "weight inf of " in _refused(r["blend_inf"]) and "not finite" in _refused(r["blend_inf"])


def test_megatron_checks_in_validate_and_unexpected_errors_recorded(results):
    root, r = results
    line = _refused(r["tc_assert"])
    assert ("Megatron-Core's TransformerConfig refuses this model and layout (Megatron-Core: \"Please use "
            "--moe-router-pre-softmax (model.moe_router_pre_softmax) when topk is 1\"). Fix: ") in line, line
    assert "Traceback" in (r["unexpected"]["escaped"] or ""), r["unexpected"]  # truly unexpected: the traceback
    status = json.loads((root / "unexpected" / "exit_status.json").read_text())
    assert status["reason"] == "failed", status
    assert status["message"].startswith("ValueError: Please use --moe-router-pre-softmax when topk is 1. at "
                                        "megatron/core/transformer/transformer_config.py:"), status


def test_path_keys_changed_on_resume(results):
    root, r = results
    run_dir = root / "run"
    assert r["base"]["rc"] == 0, r["base"]
    moved = r["moved"]
    assert moved["rc"] == 0 and moved["escaped"] is None, moved
    out = moved["stdout"]
    assert (f"[pretrain] checkpoint.dir is {root}/new (none there), but this run dir saved a newer complete "
            f"checkpoint at {run_dir}/checkpoints/iter_0000002: resuming from it, saving to {root}/new from now "
            "on") in out, out
    assert f"[pretrain] resume: checkpoint.dir null → {root}/new (from the resumed step)" in out
    assert f"[pretrain] resume: data.cache_dir null → {root}/cache2 (from the resumed step)" in out
    assert "[pretrain] resume: checkpoint.pretrained null → " in out and "(the run resumes from its own" in out
    assert (root / "new" / "iter_0000003" / "run_config.yaml").exists() and list((root / "cache2").iterdir())
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3], steps
    recorded = (run_dir / "checkpoint_dirs.txt").read_text().splitlines()
    assert recorded == ["checkpoints", str(root / "new")], recorded
    back = r["back"]
    assert back["rc"] == 0 and back["escaped"] is None, back
    note = ("nothing to train: the checkpoint resumed from is at step 3 and train.steps=2; raise train.steps to "
            "train further")
    assert f"saved a newer complete checkpoint at {root}/new/iter_0000003: resuming from it" in back["stdout"]
    assert f"[pretrain] {note}" in back["stdout"], back["stdout"]
    status = json.loads((run_dir / "exit_status.json").read_text())
    assert status == {"reason": "completed", "step": 3, "signal": None, "message": note}, status
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3


def test_smaller_refusals(results):
    _, r = results
    assert ("(model.vocab_size=null overrides the 128,256 that model.preset=llama32_1b sets)"
            in _refused(r["vocab_null"]))
    line = _refused(r["context_0"])
    assert "parallel.context=0 must be at least 1" in line and "world size 0 must" not in r["context_0"]["stderr"]
    fsdp = r["fsdp_distributed"]
    assert fsdp["rc"] == 0 and "note: optimizer.fsdp=true and optimizer.distributed=true: Megatron-FSDP runs" \
        in fsdp["stdout"], fsdp
    assert f"data.cache_dir={Path(results[0]) / 'afile'} exists and is not a directory" in _refused(
        r["cache_dir_file"])
