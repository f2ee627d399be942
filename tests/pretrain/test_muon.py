"""Muon (optimizer.name=muon): Megatron-Core's Muon + AdamW as the trainer builds it.

- one optimizer step = a plain-PyTorch Muon + AdamW written from the published algorithm (`muon_worker.py`);
- TP2 (tp_mode=duplicated) and DP2 = one rank, fp32, 4 steps; PP2, EP2 (tiny_moe), EP2 (tiny_deepseek: MLA, MTP),
  TP2+SP × DP2, TP2 / DP2 checkpoints resumed on one rank and kill -9 at DP2 in `make test-all` (Megatron-Core's
  layer-wise optimizer runs in 16-bit only: validate refuses it in fp32, with the reason per release);
- a Muon checkpoint resumes to the uninterrupted losses; an AdamW checkpoint resumed with Muon is refused, and
  starts Muon fresh with checkpoint.load_optimizer=false (printed, recorded in config.yaml);
- QK-clip rescales exactly the query groups whose recorded max logit passes the threshold;
- validate refuses what Megatron-Core's Muon does not support, with the reason.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests import tiers
from tests.pool import run_case
from tests.pool.reference import reference_run
from tests.pretrain.ckpt_helpers import log_text, metrics, rel_diff

STEPS = 4
TOLERANCE = 1e-5
MUON = ["optimizer.name=muon", "optimizer.muon.fp32_matmul_prec=highest", "optimizer.muon.tp_mode=duplicated"]
COMMON = ["data.mock=true", f"train.steps={STEPS}", "checkpoint.save_at_end=false",
          "checkpoint.interval=null", "logging.tensorboard=false", "optimizer.warmup_steps=1", *MUON]
BASE = [*COMMON, "model.num_layers=2"]  # tiny_llama, two layers


LAYOUTS = {  # name: (config, world, overrides)
    "tp2": ("tiny_llama", 2, ["parallel.tensor=2"]),
    "dp2": ("tiny_llama", 2, []),
    "pp2": ("tiny_llama", 2, ["parallel.pipeline=2"]),
    "moe_ep2": ("tiny_moe", 2, ["parallel.expert=2"]),
    "deepseek_ep2": ("tiny_deepseek", 2, ["parallel.expert=2"]),
    "tp2_sp_dp2": ("tiny_llama", 4, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
}
FULL = {"pp2", "moe_ep2", "deepseek_ep2", "tp2_sp_dp2"}


def _base(config: str) -> list[str]:
    return BASE if config == "tiny_llama" else COMMON


def _losses(run_dir) -> list[float]:
    lines = [x for x in metrics(run_dir) if "loss" in x]
    return [x["loss"] for x in lines]


@pytest.mark.slow
@pytest.mark.mcore
def test_one_step_equals_reference_muon(tmp_path):
    out, log = tmp_path / "reference.json", tmp_path / "reference.log"
    rc = run_case(1, "tests.pretrain.muon_worker", ["reference", str(out)], log, timeout=600)
    assert rc == 0, log_text(log)[-4000:]
    r = json.loads(out.read_text())
    print(f"one step vs the reference: weights {r['weights_rel']:.2e}, updates {r['update_rel']:.2e} (relative)")
    assert r["weights_rel"] <= 1e-6, r
    assert r["update_rel"] <= 5e-6, r  # AdamW's fp32 formula (torch: m/bc1 / (sqrt(v)/sqrt(bc2) + eps)) rounds
    # Megatron-Core's split: 8 matrices (QKV, proj, fc1, fc2 × 2 layers) to Muon; embedding, output, norms to AdamW
    assert r["kinds"] == {"muon": 368640, "adamw": 262784}, r
    assert "368,640 parameters in 8 matrices" in r["line"][0] and "262,784 in 7 tensors to AdamW" in r["line"][0]
    # the planner: the same split, and the optimizer state the ranks hold (momentum 4 B, AdamW moments 8 B)
    assert r["planned"] == {"muon": 368640, "adamw": 262784, "state_bytes": r["state_bytes"]}, r
    assert r["state_bytes"] == 4 * 368640 + 8 * 262784


@pytest.mark.slow
@pytest.mark.mcore
def test_qk_clip_rescales_exactly_the_heads_over_the_threshold(tmp_path):
    """Megatron-Core's clip_qk after a step (pretrain.optim.muon.after_step), on recorded max logits 150, 99, 400, 20
    per query group (threshold 100, α 0.5): groups 0 and 2 scaled exactly (queries by η^α, keys by η^(1-α)), values
    and groups 1 and 3 untouched. On GPUs the logits come from Transformer Engine's attention."""
    out, log = tmp_path / "qk.json", tmp_path / "qk.log"
    rc = run_case(1, "tests.pretrain.muon_worker", ["qk_clip", str(out)], log, timeout=600)
    assert rc == 0, log_text(log)[-4000:]
    r = json.loads(out.read_text())
    assert r["max_logit"] == 400.0
    assert [(g["group"], g["changed"]) for g in r["groups"]] == [(i % 4, i % 4 in (0, 2)) for i in range(8)], r
    assert all(g["q"] == g["k"] == g["v"] == 0.0 for g in r["groups"]), r


@pytest.mark.slow
@pytest.mark.mcore
@pytest.mark.parametrize("name", tiers.params(list(LAYOUTS), FULL))
def test_layout_equals_one_rank(name, tmp_path):
    config, world, extra = LAYOUTS[name]
    ref = reference_run(config, _base(config) + [f"run.dir={tmp_path}/ref"])
    cases = tmp_path / "cases.json"
    overrides = _base(config) + extra + [f"run.dir={tmp_path}/{name}"]
    cases.write_text(json.dumps([{"config": config, "overrides": overrides}]))
    log = tmp_path / f"{name}.log"
    rc = run_case(world, "tests.pretrain.layout_worker", [str(cases)], log, timeout=900)
    assert rc == 0, log_text(log)[-4000:]
    want, got = _losses(ref), _losses(tmp_path / name)
    assert len(want) == len(got) == STEPS, (want, got)
    worst = max(rel_diff(a, b) for a, b in zip(got, want))
    print(f"muon {name} ({config}): max relative loss difference vs one rank {worst:.2e}")
    assert worst <= TOLERANCE, (want, got)


@pytest.mark.slow
@pytest.mark.mcore
def test_resume_and_optimizer_switch(tmp_path):
    """Muon checkpoint at step 2 → resumed steps 3-4 = the uninterrupted run; AdamW → Muon refused, or fresh."""
    ref = reference_run("tiny_llama", BASE + [f"run.dir={tmp_path}/ref"])
    a, b = tmp_path / "muon", tmp_path / "adamw"
    plain = [o for o in BASE if not o.startswith("optimizer.name")]
    cases = [
        {"config": "tiny_llama", "overrides": BASE + ["train.steps=2", "checkpoint.save_at_end=true", f"run.dir={a}"]},
        {"config": "tiny_llama", "overrides": BASE + [f"run.dir={a}"]},
        {"config": "tiny_llama", "overrides": plain + ["train.steps=1", "checkpoint.save_at_end=true", f"run.dir={b}"]},
        {"config": "tiny_llama", "overrides": BASE + ["train.steps=2", f"run.dir={b}"], "refused": True},
        {"config": "tiny_llama", "overrides": BASE + ["train.steps=2", "checkpoint.load_optimizer=false",
                                                      f"run.dir={b}"]},
    ]
    spec, out, log = tmp_path / "cases.json", tmp_path / "out.json", tmp_path / "switch.log"
    spec.write_text(json.dumps(cases))
    rc = run_case(1, "tests.pretrain.muon_worker", ["switch", str(spec), str(out)], log, timeout=900)
    text = log_text(log)
    assert rc == 0, text[-4000:]
    assert _losses(a) == _losses(ref), (_losses(a), _losses(ref))  # exact: steps 1-2, then 3-4 after the resume
    refused = json.loads(out.read_text())[3]
    assert refused and "optimizer.name adamw → muon" in refused and "checkpoint.load_optimizer=false" in refused
    assert "resume: optimizer.name adamw → muon (only with checkpoint.load_optimizer=false" in text
    recorded = yaml.safe_load((b / "config.yaml").read_text())
    assert recorded["optimizer"]["name"] == "muon" and recorded["checkpoint"]["load_optimizer"] is False
    assert [x["step"] for x in metrics(b) if "loss" in x][-1] == 2


RESHARD = {"tp2": ["parallel.tensor=2"], "dp2": []}


@pytest.mark.slow
@pytest.mark.mcore
@pytest.mark.full
@pytest.mark.parametrize("name", list(RESHARD))
def test_reshard_to_one_rank(name, tmp_path):
    """A Muon checkpoint of TP2 / DP2 (layer-wise) at step 2, resumed on one rank to step 4 = the one-rank run."""
    ref = reference_run("tiny_llama", BASE + [f"run.dir={tmp_path}/ref"])
    run = tmp_path / name
    first = tmp_path / "first.json"
    first.write_text(json.dumps([{"config": "tiny_llama", "overrides": BASE + RESHARD[name] + [
        "train.steps=2", "checkpoint.save_at_end=true", f"run.dir={run}"]}]))
    rc = run_case(2, "tests.pretrain.layout_worker", [str(first)], tmp_path / "first.log", timeout=900)
    assert rc == 0, log_text(tmp_path / "first.log")[-4000:]
    spec, out, log = tmp_path / "resume.json", tmp_path / "out.json", tmp_path / "resume.log"
    spec.write_text(json.dumps([{"config": "tiny_llama", "overrides": BASE + [f"run.dir={run}"]}]))
    rc = run_case(1, "tests.pretrain.muon_worker", ["switch", str(spec), str(out)], log, timeout=900)
    assert rc == 0, log_text(log)[-4000:]
    want, got = _losses(ref), _losses(run)
    assert len(got) == STEPS, got
    worst = max(rel_diff(a, b) for a, b in zip(got, want))
    print(f"muon {name} -> one rank: max relative loss difference vs one rank {worst:.2e}")
    assert worst <= TOLERANCE, (want, got)


@pytest.mark.slow
@pytest.mark.mcore
@pytest.mark.full  # kill -9 itself: test_resume.py in `make test`; here with Muon's state at DP2
def test_kill9_and_resume_reproduce_every_loss_dp2(tmp_path):
    from tests.pretrain.ckpt_helpers import command, kill9_and_resume

    ref = reference_run("tiny_llama", BASE + [f"run.dir={tmp_path}/ref"])
    work = tmp_path / "run"
    cmd = command([], nproc=2, args=["train", "tiny_llama", *BASE, "checkpoint.interval=1", f"run.dir={work}"])
    kill_at = kill9_and_resume(cmd, work, STEPS)
    print(f"muon DP2 killed after step {kill_at}: losses {_losses(work)}")
    assert _losses(work) == _losses(ref)  # DP2 = one rank exactly, before and after the kill


def _problems(overrides: list[str], world: int = 2, config: str = "tiny_llama") -> str:
    from pretrain.config import load_config
    from pretrain.validate import validate

    r = validate(load_config(config, ["data.mock=true", *overrides]), world, cuda_available=False)
    return "\n".join(str(e) for e in r.errors)


@pytest.mark.parametrize("overrides, expected", [
    (["optimizer.name=muon", "optimizer.fsdp=true"], "does not run with Megatron-FSDP"),
    (["optimizer.name=muon", "optimizer.distributed=true"], "does not run inside the distributed optimizer"),
    (["optimizer.name=muon", "optimizer.muon.qk_clip=true"], "optimizer.muon.qk_clip needs Transformer Engine"),
    (["optimizer.name=muon", "optimizer.muon.num_ns_steps=0"], "optimizer.muon.num_ns_steps=0 must be in [1, 100]"),
    (["optimizer.name=muon", "optimizer.muon.momentum=1.0"], "optimizer.muon.momentum=1.0 must be in [0, 1)"),
    (["optimizer.name=muon", "optimizer.muon.layer_wise=true"], "optimizer.muon.layer_wise needs a 16-bit run"),
])
def test_validate_refuses(overrides, expected):
    assert expected in _problems(overrides)


def test_validate_accepts_muon_layouts():
    assert _problems(["optimizer.name=muon", "parallel.tensor=2", "optimizer.muon.layer_wise=true",
                      "train.precision=bf16"], world=4) == ""


def test_plan_shows_muon_memory_and_newton_schulz_flops():
    """Moonlight on 2 × 8 H100 (its config: Muon, layer-wise) against AdamW with the distributed optimizer."""
    from pretrain.config import load_config
    from pretrain.planner.plan import make_plan

    layout = ["data.mock=true", "parallel.expert=8"]
    muon = make_plan(load_config("moonlight_16b_a3b", layout), 2, 8, "h100")
    adamw = make_plan(load_config("moonlight_16b_a3b", [*layout, "optimizer.name=adamw",
                                                        "optimizer.distributed=true"]), 2, 8, "h100")
    mu = muon["muon"]
    print(f"moonlight optimizer GiB per GPU: Muon {muon['memory_gib']['optimizer']}, AdamW (distributed) "
          f"{adamw['memory_gib']['optimizer']}; Newton-Schulz {mu['newton_schulz_flops_per_step'] / 1e12:.1f} TFLOP")
    assert adamw["muon"] is None and mu["layer_wise"] and muon["fits"]
    assert muon["memory_gib"]["optimizer"] == mu["optimizer_gib"]
    assert mu["momentum_gib"] == round(4 * mu["muon_parameters"] / 1024 ** 3, 3)
    assert mu["newton_schulz_flops_per_step"] > 0 and mu["gather_gib"] > 0
