"""Each Megatron-Core fix (`pretrain/compat/megatron_fixes.py`) is needed exactly on the releases it names.

Single-process cases (`fix_cases.py`, run in the world-1 launch of `conftest.py::fsdp_runs`): a reference run saves at
step 2 and trains to step 4; then, for each fix in turn, the same resume (or a load of a planted pickle from a
torch_dist and from an fsdp_dtensor checkpoint, or one step with `recompute_modules: [layernorm]`, or one step of
tiny_moe or tiny_deepseek) runs with only that fix undone. The bug must show on the installed megatron-core if and
only if the fix says it is needed there. Fixes that need more ranks (`fsdp_tp_without_te`: TP2 × DP2) are shown in the
Megatron-FSDP launches too. Each Megatron-FSDP CPU shim (`pretrain/compat/fsdp_cpu.py`) is undone the same way: one
FSDP step then fails. CI runs this on 0.16.1 (`make test`) and 0.19.2 (`make test-mcore MCORE=0.19.2`). (The CPU
shim for RoPE's `pin_memory=True` under context parallelism is switched off in
tests/pretrain/test_context_parallel.py's two-process launch.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version

from pretrain.compat.fsdp_cpu import FSDP_SHIMS
from pretrain.compat.mcore import MCORE
from pretrain.compat.megatron_fixes import FIXES
from tests import tiers
from tests.pretrain.ckpt_helpers import metrics

pytestmark = [pytest.mark.slow, pytest.mark.mcore, pytest.mark.timeout(2400)]  # with the fsdp_runs launches

# Shown at TP2 × DP2 in the Megatron-FSDP world-4 launch (conftest.py::fsdp_runs): `make test-all`.
WORLD2 = ("fsdp_tp_without_te",)


@pytest.fixture(scope="module")
def without_each_fix(fsdp_runs):
    """The cases of `fix_cases.py`, run in the world-1 launch of the Megatron-FSDP runs (one launch fewer)."""
    root = fsdp_runs["root"] / "fixes"
    results = fsdp_runs["results"]
    assert results["ref"]["ok"] and results["evil"]["ok"] and results["evil_fsdp"]["ok"], results
    return root, results, root / "pwned", fsdp_runs


def _loss(run_dir: Path, step: int) -> float:
    return next(m["loss"] for m in metrics(run_dir) if m.get("step") == step and "loss" in m)


def _bug_shows(name: str, root: Path, results: dict, marker: Path, fsdp_root: Path) -> tuple[bool, str]:
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
    if name == "load_bytes_weights_only":  # torch_dist (Megatron's planner) and fsdp_dtensor (DCP's own)
        fsdp_marker = Path(fsdp_root) / "pwned_fsdp"
        both = marker.exists() and fsdp_marker.exists()
        return both, (f"marker files {'created' if both else 'absent'} (torch_dist {marker.exists()}, fsdp_dtensor "
                      f"{fsdp_marker.exists()}); {res['error']}")
    if name == "recompute_norms_without_te":  # CheckpointWithoutOutput's forward reaches TE's FP8 state
        return (not res["ok"] and "NameError" in res["traceback"] and "FP8GlobalStateManager" in res["traceback"]), \
            str(res["error"])
    if name == "moe_router_without_te":  # the router's gating GEMM tests a name defined only with TE
        return (not res["ok"] and "NameError" in res["traceback"] and "te_general_gemm" in res["traceback"]), \
            str(res["error"])
    if name == "mla_local_core_attention":  # MLA builds its core attention with k/v widths
        return (not res["ok"] and "TypeError" in res["traceback"] and "k_channels" in res["traceback"]), \
            str(res["error"])
    if name == "mla_without_te":  # isinstance(linear_proj, TELinear) with TE's placeholder class
        return (not res["ok"] and "TypeError" in res["traceback"] and "isinstance" in res["traceback"]), \
            str(res["error"])
    if name == "mla_q_norm_without_q_lora":  # 0.19's resolver wants a norm before q_proj (a fused one: TE only)
        return (not res["ok"] and "RuntimeError" in res["traceback"] and "qk_layernorm" in res["traceback"]), \
            str(res["error"])
    raise AssertionError(f"no check for fix {name}")


def _bug_shows_at_world2(name: str, results: dict) -> tuple[bool, str]:
    """Fixes whose bug needs two ranks: shown in the Megatron-FSDP launch (`fsdp_cases.py`)."""
    res = results["tp2_without_fix"]
    assert name == "fsdp_tp_without_te"
    return (not res["ok"] and "isinstance() arg 2 must be a type" in res.get("traceback", "")), str(res["error"])


@pytest.mark.parametrize("fix", [pytest.param(f, id=f.name, marks=[tiers.full] if f.name in WORLD2 else [])
                                 for f in FIXES])
def test_fix_needed_exactly_on_its_releases(without_each_fix, fix):
    root, results, marker, fsdp_runs = without_each_fix
    assert fix.condition(), f"{fix.name} only applies elsewhere (e.g. with Transformer Engine / apex)"
    if fix.name in WORLD2:
        shows, seen = _bug_shows_at_world2(fix.name, fsdp_runs["results"])
    else:
        shows, seen = _bug_shows(fix.name, root, results, marker, fsdp_runs["root"])
    print(f"megatron-core {MCORE}, without {fix.name}: {seen}")
    span = f">= {fix.since}" + (f", < {fix.fixed_in}" if fix.fixed_in else "")
    assert shows == fix.needed(), (f"{fix.name} is declared for megatron-core {span}, but on {MCORE} its bug is "
                                   f"{'present' if shows else 'absent'}: {seen}")


# Without each shim, Megatron-FSDP fails on CPU where the shim says (shared/docs/cp_and_fsdp_on_cpu.md).
SHIM_FAILURES = {"fsdp_cpu_device": "Invalid device string", "fsdp_cpu_device_mesh": "CUDA"}


@pytest.mark.parametrize("shim", FSDP_SHIMS, ids=[s.name for s in FSDP_SHIMS])
def test_fsdp_cpu_shim_needed_on_its_releases(fsdp_runs, shim):
    res = fsdp_runs["results"][shim.name]
    shows = not res["ok"] and SHIM_FAILURES[shim.name] in res.get("traceback", "")
    print(f"megatron-core {MCORE}, without {shim.name}: {res['error']}")
    assert shows == (MCORE >= Version(shim.since)), res.get("traceback", "")[-2000:]


def test_fsdp_checkpoint_objects_load_weights_only(fsdp_runs):
    """The planted pickle in an fsdp_dtensor checkpoint: refused with one line, never run."""
    res = fsdp_runs["results"]["fsdp_refused"]
    assert not res["ok"] and res["error"].startswith("CheckpointError: "), res
    assert "rng_state.0.python" in res["error"] and "refused by the weights-only loader" in res["error"], res["error"]
    assert res["marker_exists"] is False
