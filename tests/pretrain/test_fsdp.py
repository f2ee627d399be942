"""Megatron-FSDP on CPU through `train()` (`fsdp_cases.py`, launched once by `conftest.py::fsdp_runs`).

Equality (fp32, 4 steps, the per-step loss and grad norm within 1e-5 relative): ZeRO-3 and ZeRO-2 (both always
overlapped: Megatron-FSDP turns the overlap flags on itself), TP2 × FSDP DP2, against the distributed optimizer
at DP2 and against one rank. Checkpoints in the fsdp_dtensor format: kill -9 while saving and a resume in a fresh
process that reproduces every metric; DP2 → DP4 (and DP1 where megatron-core's FSDP is right on one rank) from an
asynchronously written checkpoint; ZeRO-3 → ZeRO-2; both ways across formats (an FSDP run continuing a
distributed-optimizer checkpoint and the reverse; into a non-distributed optimizer refused); `convert to-hf` of an
FSDP checkpoint giving back the imported HF model bit for bit. CI runs this on 0.16.1 and 0.19.2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.format import TRACKER, is_committed, iteration_dir, read_common
from pretrain.compat.mcore import MCORE
from tests import tiers
from tests.pretrain.ckpt_helpers import DETERMINISTIC, metrics

pytestmark = [pytest.mark.slow, pytest.mark.mcore, pytest.mark.timeout(2400)]  # the fixture: four launches

TOLERANCE = 1e-5  # loss and grad norm (the norm accumulates in float64 on CPU: cpu_shims.fp64_grad_norm)


def _steps(path: Path) -> dict[int, dict]:
    """{step: metrics line} of a run directory, or of a saved metrics.jsonl file."""
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else metrics(path)
    return {m["step"]: m for m in lines if "loss" in m}


def _rel(got: dict[int, dict], ref: dict[int, dict], steps) -> tuple[float, float]:
    """(max relative loss difference, max relative grad-norm difference) over `steps`."""
    loss = max(abs(got[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in steps)
    norm = max(abs(got[s]["grad_norm"] - ref[s]["grad_norm"]) / abs(ref[s]["grad_norm"]) for s in steps)
    return loss, norm


def _ok(runs: dict, *names: str) -> None:
    failed = {n: runs["results"].get(n, {}).get("error", "not run") for n in names
              if not runs["results"].get(n, {}).get("ok")}
    assert not failed, failed


def test_fsdp_matches_the_distributed_optimizer_and_one_rank(fsdp_runs):
    root = fsdp_runs["root"]
    world4 = tiers.everything()  # TP2 × ZeRO-3 DP2 runs at world 4: `make test-all`
    _ok(fsdp_runs, "distopt", "one_rank", "zero2", *(["tp2_fsdp_dp2"] if world4 else []))
    refs = {"distributed optimizer DP2": _steps(root / "distopt"), "one rank": _steps(root / "one_rank")}
    layouts = {
        "ZeRO-3 DP2": root / "killed_metrics.jsonl",  # the killed run, before the kill
        "ZeRO-2 DP2": root / "zero2",
        **({"TP2 × ZeRO-3 DP2": root / "tp2_fsdp_dp2"} if world4 else {}),
    }
    steps = range(1, 5)
    rows, worst = [], 0.0
    for name, path in layouts.items():
        got = _steps(path)
        assert sorted(got) == list(steps), (name, sorted(got))
        for ref_name, ref in refs.items():
            loss, norm = _rel(got, ref, steps)
            rows.append(f"{name} vs {ref_name}: loss {loss:.1e}, grad norm {norm:.1e}")
            worst = max(worst, loss / TOLERANCE, norm / TOLERANCE)
    print(f"megatron-core {MCORE}, fp32, {len(steps)} steps, max relative difference:\n  " + "\n  ".join(rows))
    assert worst <= 1, rows
    losses = [m["loss"] for m in refs["one rank"].values()]
    assert losses[-1] != losses[0]  # it trains


def test_kill9_while_saving_then_resume_in_a_fresh_process(fsdp_runs):
    root, results = fsdp_runs["root"], fsdp_runs["results"]
    assert fsdp_runs["killed_rc"] != 0  # SIGKILL inside the step-4 save
    _ok(fsdp_runs, "resumed")
    before = _steps(root / "killed_metrics.jsonl")
    after = _steps(root / "killed")
    assert sorted(after) == [1, 2, 3, 4] and results["resumed"]["summary"]["step"] == 4
    for step in (1, 2, 3, 4):  # every deterministic field, exactly
        assert tuple(after[step][k] for k in DETERMINISTIC) == tuple(before[step][k] for k in DETERMINISTIC), step
    ckpts = root / "killed" / "checkpoints"
    assert (ckpts / TRACKER).read_text().strip() == "4"
    assert is_committed(iteration_dir(ckpts, 2)) and is_committed(iteration_dir(ckpts, 4))
    info = json.loads((iteration_dir(ckpts, 4) / "metadata.json").read_text())
    assert info["sharded_backend"] == "fsdp_dtensor"


def test_resharding_and_crossing_formats(fsdp_runs):
    root = fsdp_runs["root"]
    from tests.pretrain.fsdp_cases import fsdp_on_one_rank

    dp1, dp4 = fsdp_on_one_rank(), tiers.everything()  # DP4: the world-4 launch of `make test-all`
    _ok(fsdp_runs, "fsdp_from_distopt", "distopt_from_fsdp", "zero2_from_zero3", "async",
        *(["reshard_dp1"] if dp1 else []), *(["reshard_dp4"] if dp4 else []))
    fsdp_dp2 = _steps(root / "killed_metrics.jsonl")
    distopt = _steps(root / "distopt")
    rows = {
        **({"fsdp_dtensor DP2 (async save) → FSDP DP4": _rel(_steps(root / "reshard_dp4"), fsdp_dp2, (3, 4))}
           if dp4 else {}),
        **({"fsdp_dtensor DP2 (async save) → FSDP DP1": _rel(_steps(root / "reshard_dp1"), fsdp_dp2, (3, 4))}
           if dp1 else {}),
        "torch_dist DP2 (distributed optimizer) → FSDP DP2": _rel(_steps(root / "fsdp_from_distopt"), distopt, (3, 4)),
        "fsdp_dtensor DP2 → distributed optimizer DP2": _rel(_steps(root / "distopt_from_fsdp"), fsdp_dp2, (3, 4)),
        "fsdp_dtensor ZeRO-3 DP2 → ZeRO-2 DP2": _rel(_steps(root / "zero2_from_zero3"), fsdp_dp2, (3, 4)),
    }
    print(f"megatron-core {MCORE}: steps 3-4 after the load vs the uninterrupted run (max relative loss, grad "
          "norm):\n  " + "\n  ".join(f"{k}: {a:.1e}, {b:.1e}" for k, (a, b) in rows.items()))
    assert all(a <= TOLERANCE and b <= TOLERANCE for a, b in rows.values()), rows
    for name, fmt in (("async", "fsdp_dtensor"), ("fsdp_from_distopt", "fsdp_dtensor"),
                      ("distopt_from_fsdp", "torch_dist"), ("zero2_from_zero3", "fsdp_dtensor")):  # its own format
        last = iteration_dir(root / name / "checkpoints", 4 if name != "async" else 2)
        assert is_committed(last), last
        assert json.loads((last / "metadata.json").read_text())["sharded_backend"] == fmt, name
    # The resume contract says what changed (docs/checkpoints.md, Resuming), one line each.
    log = (root / "world2.log").read_text()
    for line in ("resume: optimizer.fsdp false → true (the checkpoint is loaded across formats",
                 "resume: optimizer.fsdp true → false (the checkpoint is loaded across formats",
                 "resume: optimizer.fsdp_sharding null → optim_grads (fsdp_dtensor holds the same global tensors"):
        assert line in log, line


def test_optimizer_state_crosses_only_into_a_sharded_optimizer(fsdp_runs):
    res = fsdp_runs["results"]["ddp_from_fsdp"]
    path = fsdp_runs["root"] / "ddp_from_fsdp" / "checkpoints" / "iter_0000002"
    assert not res["ok"] and res["error"] == (
        f"CheckpointError: {path}: optimizer state crosses between the distributed optimizer and Megatron-FSDP only; "
        "this fsdp_dtensor checkpoint's optimizer state (fsdp_dtensor) does not fit this run's optimizer. Fix: set "
        "optimizer.distributed=true, or checkpoint.load_optimizer=false to start from the weights with a fresh "
        "optimizer"), res["error"]


def test_fsdp_checkpoint_holds_every_parameter_on_every_rank(fsdp_runs):
    """Empty shards and the SwiGLU split: optimizer state for every stored model tensor, SwiGLU as _w/_v."""
    from pretrain.checkpoint.format import read_index

    ckpt = iteration_dir(fsdp_runs["root"] / "killed" / "checkpoints", 2)
    common = read_common(ckpt)
    meta = read_index(ckpt).state_dict_metadata
    names = common["names"]
    assert any(k.endswith("linear_fc1.weight_w") for k in names) and not any(k.endswith("fc1.weight") for k in names)
    for stored in names:
        assert f"model.{stored}" in meta, stored
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            assert f"optimizer.state.module.module.{stored}.{kind}" in meta, (stored, kind)
    assert {"rng_state.0.torch", "rng_state.1.torch"} <= set(meta)


def test_convert_to_hf_exports_an_fsdp_checkpoint(fsdp_runs, tmp_path):
    from data_tools.convert import main as convert
    from tests.data_tools.hf_families import non_weight_files, safetensors_dir

    _ok(fsdp_runs, "hf_fsdp")
    src = fsdp_runs["hf"][0]
    run_dir = fsdp_runs["root"] / "hf_fsdp"
    ckpt = iteration_dir(run_dir / "checkpoints", 1)
    assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "fsdp_dtensor"
    assert convert(["to-hf", "--checkpoint", str(run_dir), "--output", str(tmp_path / "hf"), "--no-progress"]) == 0
    ours, theirs = safetensors_dir(tmp_path / "hf"), safetensors_dir(src)
    assert sorted(ours) == sorted(theirs)
    for name, t in theirs.items():  # lr 0: the imported weights, through FSDP's split and sharded storage
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    assert non_weight_files(tmp_path / "hf") == non_weight_files(src)


def test_fsdp_with_expert_parallelism(fsdp_runs):
    """tiny_moe at DP2 × EP2: equal to the distributed optimizer where validation allows it, else refused."""
    from tests.pretrain.fsdp_cases import fsdp_with_ep

    res = fsdp_runs["results"]["moe_fsdp_ep2"]
    if not fsdp_with_ep():
        assert not res["ok"] and "ValidationFailed" in res["error"], res
        assert "Megatron-FSDP with expert parallelism reports a wrong gradient norm" in res["error"], res["error"]
        return
    _ok(fsdp_runs, "moe_fsdp_ep2", "moe_distopt_ep2")
    root = fsdp_runs["root"]
    loss, norm = _rel(_steps(root / "moe_fsdp_ep2"), _steps(root / "moe_distopt_ep2"), range(1, 5))
    print(f"megatron-core {MCORE}: tiny_moe FSDP DP2 × EP2 vs distributed optimizer: loss {loss:.1e}, grad norm "
          f"{norm:.1e}")
    assert loss <= TOLERANCE and norm <= TOLERANCE


def test_layers_of_different_kinds_cross_formats(fsdp_runs):
    """tiny_moe with a dense first layer: Megatron-Core keys such layers one by one in torch_dist
    (`decoder.layers.<i>.…`, not stacked); the distributed optimizer's checkpoint loads into Megatron-FSDP (weights
    only: a chained MoE optimizer's state does not cross) and step 3 equals the uninterrupted run's."""
    _ok(fsdp_runs, "mixed_distopt", "mixed_fsdp_from_distopt")
    root = fsdp_runs["root"]
    got, ref = _steps(root / "mixed_fsdp_from_distopt"), _steps(root / "mixed_distopt")
    loss, norm = _rel(got, ref, (3,))
    print(f"megatron-core {MCORE}: tiny_moe (dense first layer) torch_dist → FSDP, step 3: loss {loss:.1e}, grad norm "
          f"{norm:.1e}")
    assert {3, 4} <= set(got) and loss <= TOLERANCE and norm <= TOLERANCE


def test_parts_map_rows_between_the_formats():
    """A tensor torch_dist stores in parts (Gated DeltaNet's in_proj: six parts, each split over TP on its own) and
    the whole tensor Megatron-FSDP keeps (the TP ranks' local tensors one after another): every row range of one,
    read through `pretrain/checkpoint/parts.py`, is the same rows as the other, built here with torch.chunk."""
    from pretrain.checkpoint.parts import part_to_whole, whole_to_parts

    rows = {"query": 8, "key": 8, "value": 16, "z": 16, "beta": 4, "alpha": 4}
    for tp in (1, 2, 4):
        spec = {"parts": [[n, r] for n, r in rows.items()], "tp": tp}
        parts = {n: torch.arange(r * 3, dtype=torch.float32).reshape(r, 3) + 1000 * i
                 for i, (n, r) in enumerate(rows.items())}
        whole = torch.cat([torch.cat([p.chunk(tp)[rank] for p in parts.values()]) for rank in range(tp)])
        n = whole.shape[0]
        for lo, hi in ((0, n), (3, 29), (n - 5, n), (7, 7)):
            got = [parts[name][a:b] for name, a, b in whole_to_parts(spec, lo, hi)]
            assert torch.equal(torch.cat(got) if got else whole[lo:hi], whole[lo:hi]), (tp, lo, hi)
        for name, part in parts.items():
            for lo, hi in ((0, part.shape[0]), (1, part.shape[0] - 1)):
                got = torch.cat([whole[a:b] for a, b in part_to_whole(spec, name, lo, hi)])
                assert torch.equal(got, part[lo:hi]), (tp, name, lo, hi)
