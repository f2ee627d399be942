"""Each Megatron-Core fix (`pretrain/compat/megatron_fixes.py`) is needed exactly on the releases it names.

One single-process launch of `ckpt_worker.py`: a reference run saves at step 2 and trains to step 4; then, for
each fix in turn, the same resume (or a load of a planted pickle, or one step with `recompute_modules:
[layernorm]`, or one step of tiny_moe) runs with only that fix undone. The bug must
show on the installed megatron-core if and only if the fix says it is needed there. CI runs this on 0.16.1
(`make test`) and 0.19.2 (`make test-mcore MCORE=0.19.2`). (The CPU shim for RoPE's `pin_memory=True` under context
parallelism is switched off in tests/pretrain/test_context_parallel.py's two-process launch.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.compat.mcore import MCORE
from pretrain.compat.megatron_fixes import FIXES
from tests.pretrain.ckpt_helpers import SMALL, command, log_text, metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.mcore]

BASE = SMALL + ["train.steps=4", "checkpoint.interval=2", "checkpoint.save_at_end=false", "optimizer.distributed=true"]
DISTOPT = ("distopt_fresh_state_dict", "distopt_load_missing_step", "distopt_shared_step")


@pytest.fixture(scope="module")
def without_each_fix(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixes")
    marker = root / "pwned"
    cases = [{"name": "ref", "overrides": BASE + [f"run.dir={root}/ref"]},
             {"name": "evil", "overrides": SMALL + ["train.steps=1", f"run.dir={root}/evil"], "evil_rng": str(marker)}]
    cases += [{"name": name, "overrides": BASE + [f"run.dir={root}/{name}"], "copy_from": [f"{root}/ref", 2],
               "without_fixes": [name]} for name in DISTOPT]
    cases.append({"name": "load_bytes_weights_only", "overrides": SMALL + [f"run.dir={root}/planner"],
                  "load_object": [f"{root}/evil/checkpoints/iter_0000001", "rng_state"],
                  "without_fixes": ["load_bytes_weights_only"]})
    one_step = ["train.steps=1", "checkpoint.interval=null", "checkpoint.save_at_end=false"]
    cases.append({"name": "recompute_norms_without_te", "without_fixes": ["recompute_norms_without_te"],
                  "overrides": SMALL + one_step + ["model.recompute_granularity=selective",
                                                   "model.recompute_modules=[layernorm]", f"run.dir={root}/norms"]})
    cases.append({"name": "moe_router_without_te", "config": "tiny_moe", "without_fixes": ["moe_router_without_te"],
                  "overrides": SMALL + one_step + [f"run.dir={root}/moe"]})
    plan = root / "plan.json"
    plan.write_text(json.dumps({"results": str(root / "results.json"), "cases": cases}))
    rc = run(command([], module="tests.pretrain.ckpt_worker", args=[str(plan)]), root / "worker.log", timeout=420)
    assert rc == 0, log_text(root / "worker.log")[-4000:]
    results = json.loads((root / "results.json").read_text())
    assert results["ref"]["ok"] and results["evil"]["ok"], results
    return root, results, marker


def _loss(run_dir: Path, step: int) -> float:
    return next(m["loss"] for m in metrics(run_dir) if m.get("step") == step and "loss" in m)


def _bug_shows(name: str, root: Path, results: dict, marker: Path) -> tuple[bool, str]:
    """(the bug showed with the fix undone, what was seen)."""
    res = results[name]
    if name == "distopt_fresh_state_dict":
        return (not res["ok"] and "AssertionError" in res["traceback"]), str(res["error"])
    if name == "distopt_load_missing_step":
        return (not res["ok"] and "KeyError: 'step'" in res["traceback"]), str(res["error"])
    if name == "distopt_shared_step":
        assert res["ok"], res["error"]
        got, want = _loss(root / name, 4), _loss(root / "ref", 4)
        return got != want, f"step-4 loss {got} after the resume vs {want} uninterrupted"
    if name == "load_bytes_weights_only":
        return marker.exists(), f"marker file {'created' if marker.exists() else 'absent'}; {res['error']}"
    if name == "recompute_norms_without_te":  # CheckpointWithoutOutput's forward reaches TE's FP8 state
        return (not res["ok"] and "NameError" in res["traceback"] and "FP8GlobalStateManager" in res["traceback"]), \
            str(res["error"])
    if name == "moe_router_without_te":  # the router's gating GEMM tests a name defined only with TE
        return (not res["ok"] and "NameError" in res["traceback"] and "te_general_gemm" in res["traceback"]), \
            str(res["error"])
    raise AssertionError(f"no check for fix {name}")


@pytest.mark.parametrize("fix", FIXES, ids=[f.name for f in FIXES])
def test_fix_needed_exactly_on_its_releases(without_each_fix, fix):
    root, results, marker = without_each_fix
    assert fix.condition(), f"{fix.name} only applies elsewhere (e.g. with Transformer Engine / apex)"
    shows, seen = _bug_shows(fix.name, root, results, marker)
    print(f"megatron-core {MCORE}, without {fix.name}: {seen}")
    span = f">= {fix.since}" + (f", < {fix.fixed_in}" if fix.fixed_in else "")
    assert shows == fix.needed(), (f"{fix.name} is declared for megatron-core {span}, but on {MCORE} its bug is "
                                   f"{'present' if shows else 'absent'}: {seen}")
