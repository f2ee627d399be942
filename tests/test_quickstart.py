"""Quickstart smoke test: the embedded corpus is preprocessed, 2 CPU ranks train, loss falls, HF export and
sampling run, and the loss is plotted (PNG from `pretrain report` and a text chart)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path):
    run_dir = tmp_path / "qs"
    proc = subprocess.run([sys.executable, "scripts/quickstart.py", "--steps", "12", "--run-dir", str(run_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== quickstart done" in proc.stdout
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 13))
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.5
    assert lines[-1]["consumed_samples"] == 12 * 8
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "12"
    assert (run_dir / "data" / "python_docs_text_document.idx").exists()
    assert json.loads((run_dir / "exit_status.json").read_text())["reason"] == "completed"
    assert (run_dir / "hf" / "config.json").exists()
    # Sampled text after each prompt, the report's plot and its text rendering.
    texts = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("  | ")]
    assert proc.stdout.count("48 tokens sampled (temperature 0.7, top-p 0.9, repetition penalty 1.2, seed 0)") == 2
    assert "".join(texts).replace("The Python standard library", "").strip(), proc.stdout[-3000:]
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert f"wrote {run_dir / 'report.png'}" in proc.stdout
    chart = proc.stdout.split("loss per step")[1].split("== quickstart done")[0].strip().splitlines()[1:]
    assert len(chart) == 12 and sum(row.count("*") for row in chart[:10]) == 12, chart  # one point per step
    assert chart[-1].split() == ["step", "1", "step", "12"]
