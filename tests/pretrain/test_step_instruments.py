"""Profiler window and per-rank timing through the trainer, in one 2-rank run (CPU, gloo, DP2; a pool case:
`pretrain train`'s entry point on the 2-rank pool).

`logging.profile` over steps 4-5 of 6 on both ranks: each rank's Chrome trace exists, parses, and holds exactly
the steps of the window (every recorded op inside them) with their data / forward_backward / optimizer phases.
`logging.timing_interval=3` (steps 3 and 6, outside the profiled steps) with rank 1 made a straggler
(`MEGAPRETRAIN_TEST_DELAY_RANK=1:0.5`): on both sampled steps the metrics line and the log name rank 1 as the
slowest, and rank 0's time waiting in collectives shows it.
"""

from __future__ import annotations

import json

import pytest

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import SMALL, log_text, metrics

pytestmark = pytest.mark.slow

DELAY_S = 0.5


@pytest.fixture(scope="module")
def instrumented_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("instruments")
    overrides = SMALL + ["train.steps=6", "checkpoint.interval=null", "checkpoint.save_at_end=false",
                         "logging.profile.start_step=4", "logging.profile.end_step=5", "logging.profile.ranks=[0,1]",
                         "logging.timing_interval=3", f"run.dir={run_dir}"]
    rc = run_case(2, "pretrain.__main__", ["train", "tiny_llama", *overrides], run_dir / "log", timeout=400,
                  env={"MEGAPRETRAIN_TEST_DELAY_RANK": f"1:{DELAY_S}"})
    assert rc == 0, log_text(run_dir / "log")[-3000:]
    return run_dir


@pytest.mark.parametrize("rank", [0, 1])
def test_profile_trace_covers_exactly_the_window(instrumented_run, rank):
    files = sorted(p.name for p in (instrumented_run / "profile").iterdir())
    assert files == ["rank0_steps4-5.json", "rank1_steps4-5.json"], files
    trace = json.loads((instrumented_run / "profile" / f"rank{rank}_steps4-5.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "Trace"]
    steps = {e["name"]: e for e in spans if e["name"].startswith("step ")}
    assert sorted(steps) == ["step 4", "step 5"]
    start, end = steps["step 4"]["ts"], steps["step 5"]["ts"] + steps["step 5"]["dur"]
    outside = [e["name"] for e in spans if e["ts"] < start or e["ts"] + e.get("dur", 0) > end]
    assert not outside, outside[:10]
    for name, step in steps.items():
        inside = {e["name"] for e in spans if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]}
        assert {"data", "forward_backward", "optimizer"} <= inside, (name, sorted(inside)[:20])
    ops = sum(1 for e in spans if e.get("cat") == "cpu_op")
    print(f"rank {rank}: {len(spans)} spans ({ops} ops) within steps 4-5, {(end - start) / 1e3:.0f} ms")


def test_delayed_rank_is_named_slowest(instrumented_run):
    sampled = {m["step"]: m for m in metrics(instrumented_run) if "slowest_ranks" in m}
    assert sorted(sampled) == [3, 6], sorted(sampled)
    for step, line in sampled.items():
        slowest = line["slowest_ranks"]
        assert [s["rank"] for s in slowest] == [1, 0], slowest
        assert slowest[0]["slowdown"] > 1.3 and line["max_rank_slowdown"] == pytest.approx(slowest[0]["slowdown"],
                                                                                            rel=1e-3)
        assert slowest[0]["compute_s"] - slowest[1]["compute_s"] > 0.6 * DELAY_S, slowest
        assert slowest[1]["wait_s"]["collectives"] > 0.6 * DELAY_S, slowest  # rank 0 waited for rank 1
        print(f"step {step}: {slowest}")
    log = log_text(instrumented_run / "log")
    assert log.count("timing: slowest rank 1 ×") == 2, [ln for ln in log.splitlines() if "timing:" in ln]
