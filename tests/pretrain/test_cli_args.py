"""`python -m pretrain` argument handling: every subcommand's own help, and overrides after options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.__main__ import main
from tests.pretrain.test_report import write_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv,prog", [(["plan", "--help"], "python -m pretrain plan"),
                                       (["report", "-h"], "python -m pretrain report"),
                                       (["validate", "-h"], "python -m pretrain validate"),
                                       (["train", "--help"], "python -m pretrain train")])
def test_each_subcommand_prints_its_help(argv, prog, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {prog} ")


def test_overrides_after_options(tmp_path, capsys):
    assert main(["validate", "tiny_llama", "--world-size", "2", "parallel.tensor=2", "--print-config",
                 "train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert "config OK (world size 2)" in out and "\n  tensor: 2\n" in out and "\n  steps: 7\n" in out, out

    assert main(["plan", "tiny_llama", "--nodes", "1", "parallel.tensor=2", "--gpus-per-node", "2", "--json",
                 "train.global_batch_size=16"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 2 and plan["layout"]["tensor"] == 2 and plan["layout"]["global_batch_size"] == 16

    a, b = write_run(tmp_path / "a", range(1, 6), 100.0), write_run(tmp_path / "b", range(1, 6), 200.0)
    out_png = tmp_path / "cmp.png"
    assert main(["report", str(a), "--out", str(out_png), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert out_png.read_bytes()[:4] == b"\x89PNG" and [ln[:3] for ln in lines[:2]] == ["a: ", "b: "], lines


def test_real_process_plan_help_and_mixed_validate():
    done = subprocess.run([sys.executable, "-m", "pretrain", "plan", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m pretrain plan "), done.stderr
    done = subprocess.run([sys.executable, "-m", "pretrain", "validate", "tiny_llama", "--world-size", "2",
                           "parallel.tensor=2", "data.mock=true"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines()[0] == "config OK (world size 2)", done.stdout + done.stderr
