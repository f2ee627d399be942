"""`python -m pretrain validate` says what `train` will start from (`pretrain/rules/start.py`): with a run directory
holding a checkpoint it applies train's resume contract and prints `resume from step N of DIR: what changes`, or
train's refusal (exit 2); `checkpoint.pretrained` is checked as train's load checks it first. Its verdict cache is
keyed on the checkpoint files it looked at.

One short real run (a pool case) makes the checkpoint; `train` itself is run once more to show it refuses what
`validate` refuses, with the same words.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.cli import run_cli
from tests.pretrain.ckpt_helpers import command, log_text, run

SMALL = ["data.mock=true", "model.seq_length=64", "model.vocab_size=4096", "model.num_layers=2",
         "train.global_batch_size=2", "train.micro_batch_size=2", "logging.tensorboard=false"]
MUON_REFUSAL = "cannot resume with optimizer.name adamw → muon and its optimizer state"
CACHED = "the start above was checked before against this exact config, code and checkpoint files"


def _validate(*overrides: str):
    return run_cli("pretrain", ["validate", "tiny_llama", *SMALL, *overrides])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from tests.pool import run_case

    root = tmp_path_factory.mktemp("start")
    log = root / "train.log"
    rc = run_case(1, "pretrain.__main__", ["train", "tiny_llama", *SMALL, "train.steps=2", f"run.dir={root}/run"],
                  log, 600, name="validate_start source")
    assert rc == 0, log_text(log)[-3000:]
    return root / "run"


@pytest.mark.slow
@pytest.mark.mcore
def test_validate_says_what_train_will_start_from(trained, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    ckpts = run_dir / "checkpoints"

    # Another optimizer with the checkpoint's optimizer state: refused by validate, as train refuses it.
    muon = _validate(f"run.dir={run_dir}", "train.steps=3", "optimizer.name=muon")
    assert muon.rc == 2, muon
    assert "[run.dir, optimizer.name] train would refuse to resume: " in muon.stderr, muon
    assert f"{ckpts}/iter_0000002: {MUON_REFUSAL}" in muon.stderr, muon
    log = tmp_path / "muon.log"  # the real CLI's refusal (a process: a failing pool case would end its pool)
    rc = run(command([*SMALL, f"run.dir={run_dir}", "train.steps=3", "optimizer.name=muon"]), log, timeout=600)
    assert rc == 1 and MUON_REFUSAL in log_text(log), log_text(log)[-3000:]

    # A change the contract allows: one line saying what happens; a second validate answers from the cache.
    extend = ["train.steps=4", "optimizer.lr=5e-4"]
    first = _validate(f"run.dir={run_dir}", *extend)
    assert first.rc == 0, first
    line = f"note: resume from step 2 of {ckpts}: optimizer.lr 0.001 → 0.0005 (the LR schedule is re-derived"
    assert line in first.stdout and "train.steps 2 → 4 (the run ends there" in first.stdout, first
    assert CACHED not in first.stdout, first
    again = _validate(f"run.dir={run_dir}", *extend)
    assert again.rc == 0 and line in again.stdout and CACHED in again.stdout, again

    # The checkpoint changes (its run_config.yaml now records another model): re-checked, not the cached verdict.
    saved = ckpts / "iter_0000002" / "run_config.yaml"
    tree = yaml.safe_load(saved.read_text())
    tree["model"]["ffn_hidden_size"] = 512
    saved.write_text(yaml.safe_dump(tree))
    changed = _validate(f"run.dir={run_dir}", *extend)
    assert changed.rc == 2 and CACHED not in changed.stdout + changed.stderr, changed
    assert "[run.dir, model.ffn_hidden_size] train would refuse to resume: " in changed.stderr, changed
    assert "cannot resume with model.ffn_hidden_size 512 → 352" in changed.stderr, changed

    # Weights only: a new run from the trained checkpoint; one whose index is damaged is refused as train's load
    # refuses it.
    fresh = _validate(f"run.dir={tmp_path}/new", f"checkpoint.pretrained={trained}")
    assert fresh.rc == 0, fresh
    assert f"note: start from the weights of {trained}/checkpoints/iter_0000002 (checkpoint.pretrained" \
        in fresh.stdout, fresh
    broken = tmp_path / "broken"
    shutil.copytree(trained / "checkpoints" / "iter_0000002", broken)
    (broken / ".metadata").write_bytes(b"not an index")
    bad = _validate(f"run.dir={tmp_path}/new2", f"checkpoint.pretrained={broken}")
    assert bad.rc == 2, bad
    assert f"[checkpoint.pretrained] train would refuse checkpoint.pretrained: {broken}/.metadata: unreadable or " \
           "truncated checkpoint index" in bad.stderr, bad
