"""The calibrated cost model against Megatron-Bridge's published runs (`benchmarks/published_runs.yaml`): every
calibration row predicted within ±15% of its measured tokens/s/GPU and planned as fitting, through the benchmark's
own command line; the constants table names a source for every number."""

from __future__ import annotations

import pytest

from pretrain.planner.constants import table
from pretrain.planner.published import TOLERANCE, load_runs, predict

RUNS = load_runs()


def test_the_data_file_loads_with_the_six_calibration_runs():
    calibration = [r for r in RUNS if r.get("calibration")]
    assert len(calibration) == 6
    assert {r["gpu"] for r in calibration} == {"h100", "b200"}
    assert all(source for _, _, _, source in table())


@pytest.mark.parametrize("run", [r for r in RUNS if r.get("calibration")], ids=lambda r: r["name"])
def test_calibration_run_within_15_percent_and_fits(run):
    p = predict(run)
    print(f"{p.name}: predicted {p.predicted:,.0f} vs published {p.published:,.0f} tokens/s/GPU "
          f"(×{p.ratio:.2f}), {p.memory_gib:.1f} of {p.capacity_gib:.0f} GiB")
    assert abs(p.ratio - 1) <= TOLERANCE
    assert p.fits


@pytest.mark.full  # the rows above are the same predictions; this is the command line that prints them
def test_benchmark_prints_the_table():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks/planner_vs_published.py"), "--constants"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr
    calibration = [line for line in out.stdout.splitlines() if line.endswith("| calibration |")]
    assert len(calibration) == 6 and not any("| NO |" in line for line in calibration)  # check rows may miss
    assert "`gemm_efficiency_fp8`" in out.stdout
