"""`python -m pretrain report`: PNG of loss / lr / grad norm / throughput, text summary, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.observe import report
from tests.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]


def write_run(run_dir: Path, steps: range, tokens: float, torn: bool = False) -> Path:
    run_dir.mkdir(parents=True)
    lines = []
    for s in steps:
        lines.append(json.dumps({"step": s, "loss": 10.0 / s, "lr": 1e-3 * s / steps.stop, "grad_norm": 1.0 + s,
                                 "tokens_per_s": tokens * 2, "step_time_s": 0.1, "consumed_samples": 8 * s,
                                 "tokens_per_s_per_gpu": tokens, "tflops_per_gpu": 1.5}))  # fmt: skip
        if s % 5 == 0:
            lines.append(json.dumps({"step": s, "valid_loss": 11.0 / s}))
    text = "\n".join(lines) + "\n"
    if torn:
        text += '{"step": 99, "lo'
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def test_report_compares_runs(tmp_path):
    a = write_run(tmp_path / "tp2" / "run", range(1, 11), 1000.0)
    b = write_run(tmp_path / "pp2" / "run", range(1, 21), 3000.0, torn=True)
    out = tmp_path / "cmp.png"
    proc = run_cli("pretrain", ["report", str(a), str(b), "--out", str(out)], cwd=ROOT)
    assert proc.rc == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("tp2/run: steps 1-10 (10 logged)") and "1,000 tokens/s/GPU" in lines[0]
    assert lines[1].startswith("pp2/run: steps 1-20 (20 logged)") and "3,000 tokens/s/GPU" in lines[1]
    assert "loss 10.0000 -> 0.5000" in lines[1] and "valid loss 0.5500 at step 20" in lines[1]
    assert "TFLOP/s/GPU 1.5" in lines[0] and "grad norm last 11.000" in lines[0]


def test_report_resumed_run_keeps_last_record_per_step(tmp_path):
    run = write_run(tmp_path / "run", range(1, 6), 500.0)
    with open(run / "metrics.jsonl", "a") as f:  # steps 4-5 again after a resume from step 3
        for s in (4, 5):
            f.write(json.dumps({"step": s, "loss": 0.1, "lr": 0.0, "grad_norm": 0.0, "tokens_per_s": 1.0}) + "\n")
    train, valid = report.read_metrics(run)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5] and train[-1]["loss"] == 0.1
    assert [r["step"] for r in valid] == [5]
    assert report.main([str(run)]) == 0
    assert (run / "report.png").is_file()


def test_report_missing_run_is_one_line_error(tmp_path):
    proc = run_cli("pretrain", ["report", str(tmp_path / "nope")], cwd=ROOT)
    assert proc.rc == 2
    assert proc.stderr.strip().startswith("report error:") and "metrics.jsonl" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
