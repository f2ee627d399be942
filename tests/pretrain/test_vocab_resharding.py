"""A checkpoint loads at a TP whose vocabulary padding differs (GPT-2's 50,257 tokens: 50,432 rows at TP2,
50,304 at TP1), model and distributed-optimizer state, and training continues with the same losses.
Both runs are `pretrain train`'s entry point on pool ranks (2, then 1): the subject is the load, not the launch."""

from __future__ import annotations

import shutil

import pytest

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import log_text, metrics

pytestmark = [pytest.mark.slow, pytest.mark.mcore]

COMMON = ["logging.tensorboard=false", "checkpoint.interval=2", "train.steps=4", "optimizer.distributed=true"]


def test_tp2_checkpoint_continues_at_tp1_with_other_padding(tmp_path):
    source = tmp_path / "tp2"
    rc = run_case(2, "pretrain.__main__", ["train", "tiny_gpt", *COMMON, f"run.dir={source}", "parallel.tensor=2",
                                           "parallel.sequence_parallel=true"], tmp_path / "tp2.log", timeout=600)
    assert rc == 0, log_text(tmp_path / "tp2.log")[-3000:]
    target = tmp_path / "tp1"
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "iter_0000002", target / "checkpoints" / "iter_0000002")
    (target / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2\n")
    rc = run_case(1, "pretrain.__main__", ["train", "tiny_gpt", *COMMON, f"run.dir={target}"], tmp_path / "tp1.log",
                  timeout=600)
    assert rc == 0, log_text(tmp_path / "tp1.log")[-3000:]
    assert "resumed from" in log_text(tmp_path / "tp1.log")
    want = {x["step"]: x["loss"] for x in metrics(source)}
    got = {x["step"]: x["loss"] for x in metrics(target)}
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert abs(got[step] - want[step]) / want[step] < 1e-4, (step, got[step], want[step])
