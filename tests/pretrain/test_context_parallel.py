"""Context parallelism on CPU (gloo), through `train()`: every CP layout against one rank, checkpoints, documents.

Without Transformer Engine, CP > 1 runs the local spec's `model_providers/core/cp_attention.py` (all_gather, a2a,
the p2p ring) inside Megatron-Core's GPTModel, with Megatron's own batch split, RoPE slice and DP×CP reductions.
Each layout trains 4 steps (fp32, the embedded corpus) and must give the one-rank losses and gradient norms to
1e-5 relative. One launch per world size runs all its cases (start-up dominates on CPU):

- world 2: one CP2 step without the CPU shim for RoPE's `pin_memory=True` (it must fail), CP2 with each
  cp_comm_type (p2p also saves checkpoints at steps 2 and 4), CP2 with recompute_modules=[core_attn], its step-2
  checkpoint resharded to TP2+SP, CP2 with attention dropout, packed documents (THD) at CP2;
- world 1: the references, the CP2 checkpoint loaded at CP1, each document alone;
- world 4: TP2+SP × CP2, PP2 × CP2, CP2 × DP2 with the distributed optimizer, CP2 × EP2 on tiny_moe, documents at
  TP2+SP × CP2 (a2a).

A CP2 run SIGKILLed while saving (the world-2 launch's last case) and restarted reproduces every deterministic
metric of the uninterrupted run. Under `-m mcore`
(megatron-core 0.19.2 in CI) only the layouts and the shim check run.
"""

from __future__ import annotations

import json

import pytest
from packaging.version import Version

from pretrain.compat.mcore import MCORE
from tests import tiers
from tests.pool import run_case
from tests.pretrain.ckpt_helpers import command as train_command
from tests.pretrain.ckpt_helpers import deterministic, log_text, max_rel, metrics, run, run_worker_cases, step_values
from tests.pretrain.doc_helpers import FLAGS, case, documents, first_loss, weighted_mean

pytestmark = pytest.mark.slow

STEPS = 4
TOLERANCE = 1e-5
CP2 = ["parallel.context=2"]
# name: (world, config, cp_comm_type, overrides)
LAYOUTS = {
    "cp2_p2p": (2, "tiny_llama", "p2p", CP2),
    "cp2_all_gather": (2, "tiny_llama", "all_gather", CP2 + ["parallel.cp_comm_type=all_gather"]),
    "cp2_a2a": (2, "tiny_llama", "a2a", CP2 + ["parallel.cp_comm_type=a2a"]),
    "cp2_recompute_core_attn": (2, "tiny_llama", "p2p", CP2 + ["model.recompute_granularity=selective",
                                                                "model.recompute_modules=[core_attn]"]),
    "tp2_sp_cp2": (4, "tiny_llama", "a2a", CP2 + ["parallel.cp_comm_type=a2a", "parallel.tensor=2",
                                                   "parallel.sequence_parallel=true"]),
    "pp2_cp2": (4, "tiny_llama", "p2p", CP2 + ["parallel.pipeline=2"]),
    "cp2_dp2_distopt": (4, "tiny_llama", "all_gather", CP2 + ["parallel.cp_comm_type=all_gather",
                                                               "optimizer.distributed=true"]),
    "cp2_ep2_moe": (4, "tiny_moe", "p2p", CP2 + ["parallel.expert=2"]),
}
REFERENCES = {"tiny_llama": "ref_llama", "tiny_moe": "ref_moe"}
# The checkpoint run is cp2_p2p itself (saving does not change the losses): it saves at steps 2 and 4; the
# resharded loads continue from step 2.
CKPT_RUN, CKPT_FROM = "cp2_p2p", 2
CKPT = ["checkpoint.interval=2", "checkpoint.save_at_end=true"]
RESHARD = {"cp2_to_cp1": (1, []), "cp2_to_tp2": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"])}
DROPOUT = CP2 + ["model.attention_dropout=0.1"]  # the ring draws its own masks: trains, not equal
NO_PIN_SHIM = "cp2_without_pin_memory_shim"
DOC_LAYOUTS = {"docs_cp2_p2p": (2, CP2),
               "docs_tp2_cp2": (4, CP2 + ["parallel.tensor=2", "parallel.sequence_parallel=true",
                                          "parallel.cp_comm_type=a2a"])}


# `make test-all` only: the world-4 combinations and the kill -9 at CP2 (`make test`: test_resume.py's kill -9).
FULL = {"tp2_sp_cp2", "pp2_cp2", "cp2_dp2_distopt", "cp2_ep2_moe", "docs_tp2_cp2", "kill9"}


def _common(dataset: str, run_dir, steps: int = STEPS) -> list[str]:
    return ["data.mock=false", f"data.blend=[{dataset}]", f"train.steps={steps}", "train.precision=fp32",
            "checkpoint.save_at_end=false", "checkpoint.interval=null", "logging.tensorboard=false",
            f"run.dir={run_dir}"]


def _train_case(name: str, config: str, overrides: list[str], **extra) -> dict:
    return {"name": name, "config": config, "overrides": overrides, **extra}


@pytest.fixture(scope="module")
def cp_runs(request, tmp_path_factory, embedded_dataset):
    """Every launch of this file's cases; returns the root directory (one run directory per case name), the
    documents' prediction counts and the world-2 launch's results. Under `-m mcore` (the second megatron-core
    release in CI) only the layouts and the shim check run."""
    root = tmp_path_factory.mktemp("cp")
    by_world: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    layouts = tiers.pick(LAYOUTS, FULL & set(LAYOUTS))
    for config, name in REFERENCES.items():
        if any(c == config for _, c, _, _ in layouts.values()):
            by_world[1].append(_train_case(name, config, _common(embedded_dataset, root / name)))
    mcore_only = "mcore" in (request.config.getoption("markexpr") or "")
    by_world[2].append(_train_case(NO_PIN_SHIM, "tiny_llama", _common(embedded_dataset, root / NO_PIN_SHIM, 1) + CP2,
                                   without_cpu_shims=["pin_memory_without_cuda"]))
    for name, (world, config, _, extra) in layouts.items():
        saves = CKPT if name == CKPT_RUN and not mcore_only else []
        by_world[world].append(_train_case(name, config, _common(embedded_dataset, root / name) + extra + saves))
    if mcore_only:
        results = _launch_world2(root / "w2", by_world[2], killed=False)
        for world in (1, 4):
            (root / f"w{world}").mkdir()
            run_worker_cases(root / f"w{world}", world, by_world[world], timeout=900)
        return root, {}, results
    packed, seq, singles = documents(root)
    for name, (world, extra) in RESHARD.items():
        overrides = _common(embedded_dataset, root / name) + CKPT + extra
        by_world[world].append(_train_case(name, "tiny_llama", overrides,
                                           copy_from=[str(root / CKPT_RUN), CKPT_FROM]))
    by_world[2].append(_train_case("cp2_dropout", "tiny_llama", _common(embedded_dataset, root / "cp2_dropout")
                                   + DROPOUT))
    for name, (path, n) in singles.items():
        by_world[1].append(case(root / f"doc_{name}", path, n))
    by_world[1].append(case(root / "docs_cp1", packed, seq, FLAGS))
    for name, (world, extra) in tiers.pick(DOC_LAYOUTS, FULL & set(DOC_LAYOUTS)).items():
        by_world[world].append(case(root / name, packed, seq, FLAGS + extra))
    killed = tiers.everything()
    if killed:  # last of the world-2 launch: the CP2 checkpoint run again, SIGKILLed while writing step 4's save
        by_world[2].append(_train_case("cp2_killed", "tiny_llama", _killed(embedded_dataset, root), crash_in_save=4))
    results = _launch_world2(root / "w2", by_world[2], killed=killed)
    for world in (1, 4):  # after the CP2 checkpoint: the world-1 launch loads it at CP1
        (root / f"w{world}").mkdir()
        run_worker_cases(root / f"w{world}", world, by_world[world], timeout=900)
    return root, {name: n for name, (_, n) in singles.items()}, results


def _killed(dataset: str, root) -> list[str]:
    return _common(dataset, root / "cp2_killed") + CP2 + CKPT


def _launch_world2(root, cases: list[dict], killed: bool) -> dict:
    """The world-2 cases (a pool case); when `killed`, the last case kills every rank: a real launch of its own,
    after the others. Every other case must succeed but the one without the pin_memory shim (checked by its test).
    Returns the worker's results by case name."""
    root.mkdir()
    done = cases[:-1] if killed else cases
    plan = root / "plan2.json"
    plan.write_text(json.dumps({"results": str(root / "results2.json"), "cases": done}))
    log = root / "world2.log"
    rc = run_case(2, "tests.pretrain.ckpt_worker", [str(plan)], log, timeout=900)
    results = json.loads((root / "results2.json").read_text())
    assert rc == 0 and sorted(results) == sorted(c["name"] for c in done), (rc, log_text(log)[-3000:])
    if killed:
        plan = root / "plan2_killed.json"
        plan.write_text(json.dumps({"results": str(root / "results2_killed.json"), "cases": cases[-1:]}))
        log = root / "world2_killed.log"
        rc = run(train_command([], nproc=2, module="tests.pretrain.ckpt_worker", args=[str(plan)]), log, timeout=900)
        assert rc != 0 and not (root / "results2_killed.json").exists(), (rc, log_text(log)[-3000:])
    failed = {k: v["error"] for k, v in results.items() if not v["ok"] and k != NO_PIN_SHIM}
    assert not failed, failed
    return results


@pytest.mark.mcore
@pytest.mark.parametrize("name", tiers.params(LAYOUTS, FULL))
def test_cp_layout_matches_one_rank(cp_runs, name):
    root, _, _ = cp_runs
    world, config, comm, _ = LAYOUTS[name]
    ref = root / REFERENCES[config]
    loss = max_rel(step_values(root / name, "loss"), step_values(ref, "loss"))
    norm = max_rel(step_values(root / name, "grad_norm"), step_values(ref, "grad_norm"))
    print(f"| {name} | {world} | {comm} | {loss:.1e} | {norm:.1e} |")
    assert len(step_values(root / name, "loss")) == STEPS
    assert loss <= TOLERANCE and norm <= TOLERANCE, (name, loss, norm)
    losses = step_values(root / name, "loss")
    assert losses[-1] != losses[0]  # training is happening


@pytest.mark.mcore
def test_rope_pin_memory_shim_is_needed_under_context_parallelism(cp_runs):
    """`rope_utils.get_pos_emb_on_this_cp_rank` (0.16.1 and 0.19.2) pins a host tensor, which needs CUDA: without
    the CPU shim `pin_memory_without_cuda` the first CP2 forward fails there (with it, the layouts train)."""
    from pretrain.compat.cpu_shims import SHIMS

    res = cp_runs[2][NO_PIN_SHIM]
    shim = next(s for s in SHIMS if s.name == "pin_memory_without_cuda")
    print(f"megatron-core {MCORE}, CP2 without pin_memory_without_cuda: {res['error']}")
    assert MCORE >= Version(shim.since)
    assert not res["ok"] and "get_pos_emb_on_this_cp_rank" in res["traceback"], res


@pytest.mark.parametrize("name", list(RESHARD))
def test_cp2_checkpoint_loads_at_other_layouts(cp_runs, name):
    """A CP2 checkpoint of step 2 loaded at CP1 and at TP2+SP continues with the CP2 run's losses (steps 3, 4)."""
    root, _, _ = cp_runs
    ref = {x["step"]: x for x in metrics(root / CKPT_RUN) if "loss" in x}
    got = {x["step"]: x for x in metrics(root / name) if "loss" in x}
    assert sorted(got) == list(range(1, STEPS + 1)) and sorted(ref) == sorted(got)
    for step in range(CKPT_FROM + 1, STEPS + 1):
        for key in ("loss", "grad_norm"):
            rel = abs(got[step][key] - ref[step][key]) / abs(ref[step][key])
            print(f"{name} step {step} {key}: {got[step][key]:.7f} vs CP2 {ref[step][key]:.7f} (rel {rel:.1e})")
            assert rel <= TOLERANCE, (name, step, key)


@pytest.mark.parametrize("name", tiers.params(DOC_LAYOUTS, FULL))
def test_packed_documents_under_cp_equal_documents_alone(cp_runs, name):
    """The packed sample's step-1 loss at CP2 and TP2+SP × CP2 (THD: every document padded to a multiple of 4 and
    split in zigzag chunks) equals the token-weighted mean of its documents trained alone, as at CP1
    (test_documents.py)."""
    root, predictions, _ = cp_runs
    expected = weighted_mean({d: (first_loss(root / f"doc_{d}"), n) for d, n in predictions.items()})
    got, cp1 = first_loss(root / name), first_loss(root / "docs_cp1")
    print(f"{name}: packed {got:.7f}, CP1 packed {cp1:.7f}, documents alone {expected:.7f} "
          f"(rel {abs(got - expected) / expected:.1e})")
    assert abs(got - expected) / expected < 1e-6
    assert abs(cp1 - expected) / expected < 1e-6


def test_attention_dropout_under_cp_trains(cp_runs):
    """model.attention_dropout=0.1 at CP2 (p2p: the ring draws a mask per block and keeps it for backward) trains 4
    finite steps whose losses differ from the dropout-free run's, but only slightly."""
    root, _, _ = cp_runs
    got, ref = step_values(root / "cp2_dropout", "loss"), step_values(root / "cp2_p2p", "loss")
    print(f"CP2 p2p attention_dropout=0.1 losses {got}; without dropout {ref}")
    assert len(got) == STEPS and all(x == x and abs(x) < 100 for x in got)
    assert got != ref and max_rel(got, ref) < 0.02


@pytest.mark.full
def test_kill9_at_cp2_resumes_identically(cp_runs, embedded_dataset):
    """A CP2 run SIGKILLed (every rank) while writing its step-4 checkpoint, restarted with the same command: it
    resumes from step 2 and every deterministic metric equals the uninterrupted CP2 run's (cp2_p2p)."""
    root, _, _ = cp_runs
    run_dir = root / "cp2_killed"
    assert [x["step"] for x in metrics(run_dir)] == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    rc = run(train_command(_killed(embedded_dataset, root), nproc=2), root / "restart.log", timeout=300)
    assert rc == 0, log_text(root / "restart.log")[-3000:]
    assert "iter_0000002 at step 2" in log_text(root / "restart.log")
    got, want = deterministic(run_dir), deterministic(root / CKPT_RUN)
    print(f"killed while saving step 4, resumed from step 2: {len(got)} steps, equal to the uninterrupted run: "
          f"{got == want}")
    assert [g[0] for g in got] == list(range(1, STEPS + 1))
    assert got == want
