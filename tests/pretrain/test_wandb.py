"""Weights & Biases through the trainer, offline (no network): the same scalars as TensorBoard, one run id per run
directory, and a resumed run (the requeue case) continuing that W&B run.

The offline `.wandb` transaction logs are read with wandb's own reader (`wandb leet inspect --json`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import SMALL, log_text, metrics

pytest.importorskip("wandb")
pytestmark = pytest.mark.slow

WANDB = ["logging.wandb.project=megapretrain-test", "logging.wandb.mode=offline", "logging.wandb.name=offline-run",
         "logging.tensorboard=true", "checkpoint.interval=null", "train.eval_interval=2", "train.eval_iters=1"]


def _history(wandb_file: Path) -> tuple[str, dict[int, dict[str, float]]]:
    """(run id, {step: scalars}) of an offline run, read by wandb's own transaction-log reader."""
    out = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect", str(wandb_file), "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    run_id, rows = None, {}
    for line in out.splitlines():
        rec = json.loads(line)
        if rec["type"] == "run":
            run_id = rec["run"]["run_id"]
        elif rec["type"] == "history":
            item = rec["history"]["item"]
            rows.setdefault(int(item["_step"]), {}).update({k: v for k, v in item.items() if not k.startswith("_")})
    return run_id, rows


def _tensorboard(run_dir: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    rows: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            rows.setdefault(ev.step, {})[tag] = ev.value
    return rows


def test_offline_wandb_holds_tensorboard_scalars_and_resumes_the_same_run(tmp_path):
    base = ["train", "tiny_llama", *SMALL, *WANDB, f"run.dir={tmp_path}"]
    # `pretrain train`'s entry point on a pool rank, twice in one process: wandb.init / finish per run.
    rc = run_case(1, "pretrain.__main__", [*base, "train.steps=3"], tmp_path / "log1", timeout=600)
    assert rc == 0, log_text(tmp_path / "log1")[-3000:]
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    # Requeued job: same run.dir, resumes from the step-3 checkpoint and continues to step 5.
    rc = run_case(1, "pretrain.__main__", [*base, "train.steps=5"], tmp_path / "log2", timeout=600)
    assert rc == 0, log_text(tmp_path / "log2")[-3000:]
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2, files
    (id1, first), (id2, second) = _history(files[0]), _history(files[1])
    assert id1 == id2 == run_id
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5], (sorted(first), sorted(second))
    logged = {**first, **second}
    tb = _tensorboard(tmp_path)  # both runs' events (the second appends after resuming)
    assert sorted(tb) == [1, 2, 3, 4, 5]
    for step, row in tb.items():
        assert set(logged[step]) == set(row), (step, sorted(logged[step]), sorted(row))
        for key, value in row.items():  # TensorBoard stores float32
            assert logged[step][key] == pytest.approx(value, rel=1e-6), (step, key)
    lines = {m["step"]: m for m in metrics(tmp_path) if "loss" in m}
    assert [logged[s]["train/loss"] for s in range(1, 6)] == [lines[s]["loss"] for s in range(1, 6)]
    assert "train/valid_loss" in logged[2] and "train/valid_loss" in logged[4]
    print(f"W&B run {run_id}: steps {sorted(first)} then {sorted(second)}; scalars per step: {sorted(logged[4])}")
