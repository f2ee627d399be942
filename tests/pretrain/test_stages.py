"""A run in stages (docs/training.md "Stages"): one staged run at world 2 through the CLI — a batch-size ramp
(Megatron-Core's calculator), a data switch with a WSD anneal, and a 32K-style extension that changes the sequence
length and the layout (DP2 → CP2: exit 76) — killed with -9 mid-stage and right after a boundary checkpoint and
restarted with the same command, equal to the uninterrupted run bitwise. `make test-all` adds: the first stage
equals a plain run, the CP / TP / PP stage equals the same stage at the original layout (≤ 1e-5).

The refusals, the example config, the planner's stage table, the report and the sinks: `test_stages_config.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from pathlib import Path

import pytest

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import (
    command,
    finish,
    kill_group,
    linger_in_next_step,
    log_text,
    metrics,
    run,
    start,
    wait_until,
    worker_ranks,
)

pytestmark = [pytest.mark.slow, pytest.mark.mcore]

SEED = int(os.environ.get("STAGES_TEST_SEED", random.SystemRandom().randrange(10**6)))
RAMP = [2, 2, 8]  # start 2, +2, over 8 samples: steps 1-4 take 2 samples, then 4 (the target)
STEPS = {"pretrain": 5, "anneal": 3, "long": 2}
BOUNDARIES = {"pretrain": 5, "anneal": 8}
# What the runs are compared on (the logged lr is left out: its step alignment is another change's).
FIELDS = ("step", "stage", "loss", "grad_norm", "consumed_samples", "global_batch_size")


def staged_config(root: Path, datasets: dict, long_set: dict | None = None, stages: bool = True) -> Path:
    """The scenario's YAML: tiny Llama, blend a → b at the anneal (WSD decay over it), then long: sequence 64 → 128
    keeping the tokens per batch, at CP2 unless `long_set` says otherwise. `stages=False`: the plain run of the
    first stage's settings and the run's length."""
    cfg = {
        "model": {"preset": "tiny_llama", "num_layers": 2, "seq_length": 64},
        "data": {"blend": [datasets["a"]], "split": "100,0,0"},
        "train": {"global_batch_size": 4, "micro_batch_size": 1, "rampup_batch_size": RAMP},
        "optimizer": {"decay_style": "WSD", "decay_steps": 8, "wsd_decay_steps": 3, "warmup_steps": 1, "lr": 1e-3,
                      "min_lr": 1e-4},
        "checkpoint": {"interval": 2, "keep_last": 1},
        "logging": {"tensorboard": False},
    }
    if stages:
        cfg["stages"] = [
            {"name": "pretrain", "steps": STEPS["pretrain"]},
            {"name": "anneal", "steps": STEPS["anneal"], "set": {"data.blend": [datasets["b"]]}},
            {"name": "long", "steps": STEPS["long"], "keep": "tokens",
             "set": {"model.seq_length": 128, **({"parallel.context": 2} if long_set is None else long_set)}},
        ]
    else:
        cfg["train"]["steps"] = sum(STEPS.values())
    path = root / ("staged.yaml" if stages else "plain.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def kill9(proc) -> None:
    """kill -9 of a torchrun launch: its ranks (each in its own session) with their helper processes, then the
    launcher."""
    import psutil

    victims = []
    for pid in worker_ranks(proc).values():
        with contextlib.suppress(psutil.Error):
            rank = psutil.Process(pid)
            victims += [rank, *rank.children(recursive=True)]
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    kill_group(proc)
    finish(proc, timeout=60)
    psutil.wait_procs(victims, timeout=30)


def rows(run_dir: Path) -> list[tuple]:
    return [tuple(m.get(k) for k in FIELDS) for m in metrics(run_dir) if "loss" in m]


def pooled_run(config: Path, run_dir: Path, log: Path) -> list[int]:
    """The whole staged run on the 2-rank pool, started again after each exit 76: the exit statuses of the starts."""
    out = run_dir.parent / f"{run_dir.name}.codes.json"
    rc = run_case(2, "tests.pretrain.stages_worker", ["train", str(config), f"run.dir={run_dir}"], log, timeout=900,
                  env={"OUT": str(out)})
    assert rc == 0, log_text(log)[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(small_datasets, tmp_path_factory):
    """The uninterrupted staged run (its exit 76 at the layout change included)."""
    root = tmp_path_factory.mktemp("stages_reference")
    config = staged_config(root, small_datasets)
    codes = pooled_run(config, root / "run", root / "run.log")
    assert codes == [76, 0], codes
    return config, root / "run"


def megatron_batch(consumed: int) -> int:
    """The global batch Megatron-Core's calculator gives at `consumed` samples for RAMP and a target of 4: its
    RampupBatchsizeNumMicroBatchesCalculator where the release has it (0.16), else its documented arithmetic."""
    from megatron.core import num_microbatches_calculator as calc

    start, increment, samples = RAMP
    if hasattr(calc, "RampupBatchsizeNumMicroBatchesCalculator"):
        c = calc.RampupBatchsizeNumMicroBatchesCalculator(4, 1, 2, False, -1, start, increment, samples)
        c.update(consumed, True)
        return c.get_current_global_batch_size()
    return 4 if consumed > samples else start + int(consumed / (samples / ((4 - start) // increment))) * increment


def test_staged_run_killed_and_restarted_equals_the_uninterrupted_run(reference, tmp_path):
    """kill -9 at a random step of the first stage (mid-ramp), kill -9 right after the first boundary checkpoint,
    exit 76 at the layout change, the same command again: every step's loss, gradient norm, samples and batch are the
    uninterrupted run's, bitwise; the stage is on every metrics line; the boundary checkpoints are named for their
    stage and kept with checkpoint.keep_last=1; the ramp is Megatron's calculator step by step."""
    config, ref = reference
    want = rows(ref)
    names = [n for n, k in STEPS.items() for _ in range(k)]
    assert [r[:2] for r in want] == list(enumerate(names, 1)), want
    consumed = [0] + [r[4] for r in want]
    assert [r[5] for r in want[:STEPS["pretrain"]]] == [megatron_batch(c) for c in consumed[:STEPS["pretrain"]]]
    assert [r[5] for r in want] == [2, 2, 2, 2, 4, 4, 4, 4, 2, 2]  # the ramp, then the anneal, then 32 → 128 tokens
    assert "resume: data.blend" in log_text(ref.parent / "run.log")

    rng = random.Random(SEED)
    run_dir = tmp_path / "run"
    cmd = command([], nproc=2, args=["train", str(config), f"run.dir={run_dir}"])
    kill_after = rng.randrange(3, 5)  # mid-ramp: the checkpoint of step 2 (or 4) is resumed, with 2 samples per step
    proc = start(cmd, tmp_path / "1.log")
    wait_until(lambda: len(metrics(run_dir)) >= kill_after, proc, timeout=600)
    linger_in_next_step(proc, run_dir, kill_after, rng, 0.6)
    kill9(proc)

    link = run_dir / "checkpoints" / "stage_pretrain"
    proc = start(cmd, tmp_path / "2.log")
    assert wait_until(link.is_symlink, proc, timeout=600), log_text(tmp_path / "2.log")[-3000:]
    kill9(proc)  # right after the boundary checkpoint: the anneal stage is being built
    reached = len(metrics(run_dir))
    assert reached < BOUNDARIES["anneal"], reached

    rc = run(cmd, tmp_path / "3.log", timeout=600)
    status = json.loads((run_dir / "exit_status.json").read_text())
    # Each rank exits 76; torchrun itself says 1 (a failed child) and names the ranks' exit code.
    assert rc != 0 and "exitcode  : 76" in log_text(tmp_path / "3.log"), log_text(tmp_path / "3.log")[-3000:]
    assert status["reason"] == "stage" and status["step"] == BOUNDARIES["anneal"], status
    assert "stage 'long' changes the layout" in status["message"], status
    rc = run(cmd, tmp_path / "4.log", timeout=600)
    assert rc == 0, log_text(tmp_path / "4.log")[-3000:]
    print(f"seed {SEED}: killed after step {kill_after}, then after the pretrain boundary (metrics at step {reached})")

    assert rows(run_dir) == want  # exact floats
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000005", "iter_0000008", "iter_0000010"]
    assert {p.name: os.readlink(p) for p in checkpoints.glob("stage_*")} == {
        "stage_pretrain": "iter_0000005", "stage_anneal": "iter_0000008"}


@pytest.mark.full
def test_first_stage_is_the_plain_run(reference, small_datasets, tmp_path):
    """The first stage = a plain run with its settings and the run's length (the same samples, the same schedule):
    its steps equal bitwise."""
    _, ref = reference
    plain = staged_config(tmp_path, small_datasets, stages=False)
    rc = run_case(2, "pretrain.__main__", ["train", str(plain), f"run.dir={tmp_path / 'plain'}"],
                  tmp_path / "plain.log", timeout=600)
    assert rc == 0, log_text(tmp_path / "plain.log")[-3000:]
    n = STEPS["pretrain"]
    got = [(r[0],) + r[2:5] for r in rows(tmp_path / "plain")[:n]]
    assert got == [(r[0],) + r[2:5] for r in rows(ref)[:n]]


@pytest.fixture(scope="module")
def original_layout(small_datasets, tmp_path_factory):
    """The staged run whose long stage keeps the layout (DP2): it runs in one start, no exit 76."""
    root = tmp_path_factory.mktemp("stages_dp2")
    codes = pooled_run(staged_config(root, small_datasets, long_set={}), root / "run", root / "run.log")
    assert codes == [0], codes
    return root / "run"


LONG_LAYOUTS = {"tp2": {"parallel.tensor": 2, "parallel.sequence_parallel": True}, "pp2": {"parallel.pipeline": 2}}


@pytest.mark.full
@pytest.mark.parametrize("layout", ["cp2", *LONG_LAYOUTS])
def test_a_stage_that_changes_the_layout_equals_it_at_the_original_layout(reference, original_layout,
                                                                          small_datasets, tmp_path, layout):
    """The long stage at CP2 (the reference), TP2 + SP or PP2 against the same stage at the original layout (DP2):
    the same losses to ≤ 1e-5; every step before it bitwise."""
    if layout == "cp2":
        got = rows(reference[1])
    else:
        codes = pooled_run(staged_config(tmp_path, small_datasets, long_set=LONG_LAYOUTS[layout]), tmp_path / "run",
                           tmp_path / "run.log")
        assert codes == [76, 0], codes
        got = rows(tmp_path / "run")
    want = rows(original_layout)
    cut = BOUNDARIES["anneal"]
    assert got[:cut] == want[:cut]
    assert len(got) == len(want) == sum(STEPS.values())
    worst = max(abs(a[2] - b[2]) / abs(b[2]) for a, b in zip(got[cut:], want[cut:]))
    print(f"long stage at {layout} vs DP2: losses {[a[2] for a in got[cut:]]} vs {[b[2] for b in want[cut:]]}, "
          f"max relative difference {worst:.2e}")
    for a, b in zip(got[cut:], want[cut:]):
        assert a[:2] == b[:2] and a[4:] == b[4:], (a, b)
        assert abs(a[2] - b[2]) <= 1e-5 * abs(b[2]), (layout, a, b)
