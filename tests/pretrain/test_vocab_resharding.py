"""A checkpoint loads at a TP whose vocabulary padding differs (GPT-2's 50,257 tokens: 50,432 rows at TP2,
50,304 at TP1), model and distributed-optimizer state, and training continues with the same losses."""

from __future__ import annotations

import shutil

import pytest

from tests.pretrain.ckpt_helpers import command, metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.mcore]

COMMON = ["logging.tensorboard=false", "checkpoint.interval=2", "train.steps=4", "optimizer.distributed=true"]


def test_tp2_checkpoint_continues_at_tp1_with_other_padding(tmp_path):
    source = tmp_path / "tp2"
    assert run(command([], nproc=2, args=["train", "tiny_gpt", *COMMON, f"run.dir={source}",
                                          "parallel.tensor=2", "parallel.sequence_parallel=true"]),
               tmp_path / "tp2.log") == 0
    target = tmp_path / "tp1"
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "iter_0000002", target / "checkpoints" / "iter_0000002")
    (target / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2\n")
    assert run(command([], args=["train", "tiny_gpt", *COMMON, f"run.dir={target}"]), tmp_path / "tp1.log") == 0
    want = {x["step"]: x["loss"] for x in metrics(source)}
    got = {x["step"]: x["loss"] for x in metrics(target)}
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert abs(got[step] - want[step]) / want[step] < 1e-4, (step, got[step], want[step])
