"""Checkpoints move between megatron-core releases: written by one, continued by the other with the same losses.

Needs two interpreters with different megatron-core releases beside the repository (`make install` and
`make install MCORE=0.19.2` create `.venv` and `.venv-mcore-0.19.2`); skipped otherwise. Each direction:
the writer trains 4 steps (distributed optimizer, checkpoint at step 2); the reader resumes a copy of the
step-2 checkpoint and must reproduce the writer's steps 3 and 4.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.pretrain.ckpt_helpers import DETERMINISTIC, REPO, SMALL, log_text, metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.mcore]

OVERRIDES = SMALL + ["train.steps=4", "checkpoint.interval=2", "optimizer.distributed=true"]


def _interpreters() -> dict[str, str]:
    """{megatron-core version: python} for the venvs beside the repository (one per release)."""
    found: dict[str, str] = {}
    for venv in [REPO / ".venv", *sorted(REPO.glob(".venv-mcore-*"))]:
        python = venv / "bin" / "python"
        if not python.exists():
            continue
        done = subprocess.run([str(python), "-c", "from importlib.metadata import version; "
                               "print(version('megatron-core'))"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": ""})
        if done.returncode == 0:
            found.setdefault(done.stdout.strip(), str(python))
    return found


INTERPRETERS = _interpreters()


def _train(python: str, run_dir: Path) -> None:
    cmd = [python, "-m", "pretrain", "train", "tiny_llama", *OVERRIDES, f"run.dir={run_dir}"]
    rc = run(cmd, run_dir.parent / f"{run_dir.name}.log", timeout=300)
    assert rc == 0, log_text(run_dir.parent / f"{run_dir.name}.log")[-3000:]


@pytest.mark.skipif(len(INTERPRETERS) < 2, reason="needs two venvs with different megatron-core releases "
                    f"(found {sorted(INTERPRETERS) or 'none'}): make install; make install MCORE=0.19.2")
@pytest.mark.parametrize("writer,reader", list(itertools.permutations(sorted(INTERPRETERS)[:2], 2)))
def test_checkpoint_continues_on_the_other_release(tmp_path, writer, reader):
    written = tmp_path / "written"
    _train(INTERPRETERS[writer], written)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(written / "checkpoints" / "iter_0000002", resumed / "checkpoints" / "iter_0000002")
    (resumed / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2\n")
    _train(INTERPRETERS[reader], resumed)
    log = log_text(tmp_path / "resumed.log")
    assert "resumed from" in log and f"written by megatron-core {writer}, continuing with {reader}" in log, log
    want = {m["step"]: m for m in metrics(written) if "loss" in m}
    got = {m["step"]: m for m in metrics(resumed) if "loss" in m}
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        print(f"{writer} → {reader}, step {step}: loss {got[step]['loss']} vs {want[step]['loss']}")
        assert tuple(got[step][k] for k in DETERMINISTIC) == tuple(want[step][k] for k in DETERMINISTIC)
