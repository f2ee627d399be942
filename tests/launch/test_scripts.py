"""launch/*.sh without a cluster: shellcheck-clean, and a clear error when not run under Slurm."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "launch").glob("*.sh"))


def test_launch_scripts_exist():
    names = {p.name for p in SCRIPTS}
    assert {"common.sh", "pretrain_70b.sh", "pretrain_8b.sh", "pretrain_tiny.sh"} <= names


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck_clean():
    scripts = [*SCRIPTS, REPO / "tests" / "launch" / "local_slurm.sh"]
    done = subprocess.run(["shellcheck", "-x", *map(str, scripts)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("script", ["pretrain_tiny.sh", "pretrain_8b.sh", "pretrain_70b.sh"])
def test_outside_slurm_fails_with_a_clear_message(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(REPO / "launch" / script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert "not inside a Slurm job: submit with `sbatch" in done.stderr, done.stderr
