"""Start-up at scale, on 2 ranks through `train()`: the dataset files are checked by rank 0 alone and its verdict
is every rank's (a bad dataset stops both with the same message); Megatron's index caches are written once, by
rank 0, and a restart writes none; at TP2 only the first rank of the TP group builds datasets, and the losses
are DP2's. One torchrun launch (tests/pretrain/data_scale_worker.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import metrics

pytestmark = pytest.mark.slow  # GPTDataset is on 0.19.2 in the other mcore launches; this one is start-up cost


@pytest.fixture(scope="module")
def results(small_datasets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data_scale")
    a, b = small_datasets["a"], small_datasets["b"]
    bad = str(tmp / "truncated_text_document")
    for ext in ("bin", "idx", "meta.json"):
        shutil.copy(f"{a}.{ext}", f"{bad}.{ext}")
    os.truncate(f"{bad}.bin", 1000)
    common = ["data.mock=false", "train.steps=2", "checkpoint.save_at_end=false", "checkpoint.interval=null",
              "logging.tensorboard=false"]
    blend = f"data.blend=[0.5,{a},0.5,{b}]"
    cases = [
        {"name": "dp2", "overrides": [*common, blend, f"run.dir={tmp / 'dp2'}"]},
        {"name": "dp2_restart", "overrides": [*common, blend, f"run.dir={tmp / 'dp2'}"]},
        {"name": "tp2", "overrides": [*common, blend, "parallel.tensor=2", f"run.dir={tmp / 'tp2'}"]},
        {"name": "bad", "overrides": [*common, f"data.blend=[0.5,{a},0.5,{bad}]", f"run.dir={tmp / 'bad'}"]},
    ]
    for case in cases:
        case["config"] = "tiny_llama"
    (tmp / "cases.json").write_text(json.dumps(cases))
    log = tmp / "worker.log"
    rc = run_case(2, "tests.pretrain.data_scale_worker", [str(tmp / "cases.json"), str(tmp / "out.json")], log,
                  timeout=600)
    assert rc == 0, log.read_text()[-4000:]
    return json.loads((tmp / "out.json").read_text()), tmp, log.read_text(), bad


def test_rank0_checks_the_files_and_every_rank_gets_its_verdict(results):
    out, _, _, bad = results
    for name in ("dp2", "dp2_restart", "tp2", "bad"):
        assert [r["calls"].get("check_dataset", 0) for r in out[name]] == [2, 0], (name, out[name])
    rank0, rank1 = (r["error"] for r in out["bad"])
    assert rank0 == rank1 and f"{bad}.bin: 1000 bytes but the index describes" in rank0, rank0


def test_caches_written_once_by_rank0_and_not_on_restart(results):
    out, _, log, _ = results
    # Two GPTDatasets (3 arrays each) and the BlendedDataset (2): all written by rank 0; rank 1 reads them.
    assert [r["calls"].get("numpy.save", 0) for r in out["dp2"]] == [8, 0], out["dp2"]
    assert [r["calls"].get("GPTDataset", 0) for r in out["dp2"]] == [2, 2]
    assert [r["calls"].get("numpy.save", 0) for r in out["dp2_restart"]] == [0, 0], out["dp2_restart"]
    assert "Megatron's dataset indices built in" in log and "nothing rebuilt" in log


def test_tp2_reads_on_one_rank_and_trains_like_dp2(results):
    out, tmp, _, _ = results
    assert [r["calls"].get("GPTDataset", 0) for r in out["tp2"]] == [2, 0], out["tp2"]
    dp2, tp2 = ([x["loss"] for x in metrics(tmp / name)] for name in ("dp2", "tp2"))
    assert len(dp2) == len(tp2) == 2
    assert all(abs(x - y) <= 1e-4 * abs(x) for x, y in zip(dp2, tp2)), (dp2, tp2)
