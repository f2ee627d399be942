"""The resume contract (pretrain/checkpoint/contract.py) and kills during the commit, through `train()`.

One single-process launch of tests/pretrain/ckpt_worker.py runs a chain of runs from one 2-step source run:
the same run directory resumed with a changed schedule (longer run, lr, min_lr, warmup, decay style), another
batch size, another tokenizer of the same size, another model; killed at the nasty points of the commit and
restarted with the same command; an asynchronous writer killed. (The distributed-optimizer toggle runs on
both megatron-core releases, in test_checkpointing.py.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.pretrain.ckpt_helpers import SMALL, command, log_text, metrics, run

ROOT = Path(__file__).resolve().parents[2]
# tiny_llama (lr 1e-3, min_lr 1e-4, cosine) cut to 2 layers and one microbatch of 4 per step.
BASE = SMALL + ["model.num_layers=2", "train.global_batch_size=4", "train.micro_batch_size=4",
                "checkpoint.interval=2", "optimizer.warmup_steps=1"]
SCHEDULE = ["train.steps=5", "optimizer.min_lr=5e-4", "optimizer.warmup_steps=2", "optimizer.decay_style=linear"]


def closed_form_lr(step: int, *, lr=1e-3, min_lr=1e-4, warmup=1, steps: int, decay_steps=None, style="cosine"):
    """The learning rate after `step` optimizer steps (Megatron-Core's OptimizerParamScheduler; metrics.jsonl logs it
    at step + 1, the step that applies it): linear warmup from 0, then decay to min_lr over
    max(decay_steps or train.steps, warmup + 1) steps."""
    decay = max(decay_steps or steps, warmup + 1)
    if warmup and step <= warmup:
        return lr * step / warmup
    if step > decay:
        return min_lr
    ratio = (step - warmup) / (decay - warmup)
    coeff = 1 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return min_lr + coeff * (lr - min_lr)


# --------------------------------------------------------------------------------------------------
# Every config field has a class (no launch)
# --------------------------------------------------------------------------------------------------


def test_every_config_field_has_one_resume_class():
    from pretrain.checkpoint.contract import CHANGE, FIELDS, MATCH, UNUSED, config_fields

    fields = config_fields()
    missing = sorted(set(fields) - set(FIELDS))
    assert not missing, f"config fields declaring no resume rule (knob(resume=) or a section RESUME): {missing}"
    assert not sorted(set(FIELDS) - set(fields)), "FIELDS names keys that are not config fields"
    assert {cls for cls, _ in FIELDS.values()} == {MATCH, CHANGE, UNUSED}
    # A new field appears in config_fields (which walks the dataclass tree), so this test fails until it is classed.
    from pretrain.config import Config

    @dataclasses.dataclass
    class Extended(Config):
        extra: int = 0

    assert "extra" in config_fields(Extended) and "extra" not in FIELDS


def test_docs_table_lists_every_field():
    """docs/checkpoints.md "Resuming": each field in the row of its section, class and what happens, and nothing
    else (the table `python -m pretrain.checkpoint.contract` prints from the fields' declarations)."""
    from pretrain.checkpoint.contract import FIELDS

    text = (ROOT / "docs/checkpoints.md").read_text()
    rows = {}
    for line in text.split("## Resuming", 1)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.setdefault((cells[0].strip("`"), cells[2], cells[3]), set()).update(
                re.findall(r"`([^`]+)`", cells[1]))
    declared = {}
    for key, (cls, how) in FIELDS.items():
        section, _, name = key.rpartition(".")
        section = section or "(top level)"  # `stages`
        assert name in rows.get((section, cls, how), set()), f"{key} ({cls}: {how}) is not in its docs row"
        declared.setdefault((section, cls, how), set()).add(name)
    assert rows == declared, "docs/checkpoints.md's Resuming table names fields or rows the declarations do not"


# --------------------------------------------------------------------------------------------------
# One launch
# --------------------------------------------------------------------------------------------------


def chain_cases(root: Path) -> list[dict]:
    """The cases of the launch (and the tokenizer files they use, written under `root`)."""
    from pretrain.tokenizer.embedded import MISTRAL_TOKENIZER

    data = MISTRAL_TOKENIZER.read_bytes()
    piece = b"\x0a\x06\xe2\x96\x81the\x15"  # the piece "▁the" (length 6) in the model proto: renamed "▁thQ"
    assert data.count(piece) == 1
    (root / "other.model").write_bytes(data.replace(piece, b"\x0a\x06\xe2\x96\x81thQ\x15"))  # 32,000 pieces still
    shutil.copy(MISTRAL_TOKENIZER, root / "copy.model")

    def case(name, extra, run_dir=None, **kw):
        return {"name": name, "overrides": BASE + extra + [f"run.dir={root}/{run_dir or name}"], **kw}

    src = [f"{root}/base", 2]
    return [
        case("base", ["train.steps=2"]),
        # Extend the run; killed after run_config.yaml of iter 4, before the tracker.
        case("extend", ["train.steps=4"], copy_from=src, die_at=["run_config", 4]),
        case("extend_again", ["train.steps=4"], run_dir="extend"),
        # min_lr, warmup and decay style; killed after the tracker, before the journal is removed.
        case("schedule", SCHEDULE, copy_from=src, die_at=["tracker", 4]),
        case("schedule_again", SCHEDULE, run_dir="schedule"),
        # lr; killed while pruning iter 2 (its run_config.yaml removed, its files not yet).
        case("lr", ["train.steps=4", "optimizer.lr=5e-4", "checkpoint.keep_last=1"], copy_from=src,
             die_at=["prune", 4]),
        case("lr_again", ["train.steps=4", "optimizer.lr=5e-4", "checkpoint.keep_last=1"], run_dir="lr"),
        case("pretrained_partial", ["train.steps=1", f"checkpoint.pretrained={root}/lr/checkpoints/iter_0000002"]),
        case("smaller_batch", ["train.steps=3", "train.global_batch_size=2", "train.micro_batch_size=2"],
             copy_from=src),
        case("tokenizer_same_size", ["train.steps=3", f"data.tokenizer_model={root}/other.model"], copy_from=src),
        case("tokenizer_copy", ["train.steps=2", f"data.tokenizer_model={root}/copy.model"], copy_from=src),
        # The vocabulary is raised too so that validation's vocabulary rule passes (GPT-2's EOD is id 50,256): the
        # tokenizer refusal comes first and names both tokenizers.
        case("tokenizer_type", ["train.steps=3", "data.tokenizer_type=GPT2BPETokenizer", "model.vocab_size=50304"],
             copy_from=src),
        case("model_changed", ["train.steps=3", "model.activation=gelu", "model.normalization=LayerNorm"],
             copy_from=src),
        case("writer_killed", ["train.steps=3", "checkpoint.async_save=true"], copy_from=src,
             writer_dies_in_save=3),
    ]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    cases = chain_cases(root)
    plan = root / "plan.json"
    plan.write_text(json.dumps({"results": str(root / "results.json"), "cases": cases}))
    log = root / "worker.log"
    rc = run(command([], module="tests.pretrain.ckpt_worker", args=[str(plan)]), log, timeout=600)
    assert rc == 0, log_text(log)[-4000:]
    return root, json.loads((root / "results.json").read_text()), log_text(log)


def _ok(results, name):
    assert results[name]["ok"], (name, results[name].get("traceback") or results[name]["error"])
    return results[name]["summary"]


def _lrs(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["lr"] for m in metrics(run_dir) if "loss" in m}


def _tracker(run_dir: Path) -> str:
    return (run_dir / "checkpoints/latest_checkpointed_iteration.txt").read_text().strip()


@pytest.mark.slow
def test_new_schedule_applies_from_the_resumed_step(chain):
    root, results, log = chain
    _ok(results, "base")
    assert _lrs(root / "base") == {s: closed_form_lr(s - 1, steps=2) for s in (1, 2)}
    # (run dir, its config, the resume lines): steps after 2 follow the new config's closed form, which the
    # checkpoint's schedule (ended at step 2: min_lr from there) would not.
    expected = {
        "extend": ({"steps": 4}, ["resume: train.steps 2 → 4"]),
        "schedule": ({"steps": 5, "min_lr": 5e-4, "warmup": 2, "style": "linear"},
                     ["resume: optimizer.min_lr 0.0001 → 0.0005", "resume: optimizer.warmup_steps 1 → 2",
                      "resume: optimizer.decay_style cosine → linear", "resume: train.steps 2 → 5"]),
        "lr": ({"steps": 4, "lr": 5e-4}, ["resume: optimizer.lr 0.001 → 0.0005", "resume: train.steps 2 → 4"]),
    }
    for name, (schedule, lines) in expected.items():
        lrs = _lrs(root / name)
        assert sorted(lrs) == list(range(1, schedule["steps"] + 1)), name
        for s in range(3, schedule["steps"] + 1):
            assert lrs[s] == pytest.approx(closed_form_lr(s - 1, **schedule), rel=1e-12), (name, s, lrs)
        assert lrs[3] != pytest.approx(1e-4), name  # the checkpoint's schedule: min_lr after step 2
        for line in lines:
            assert line in log, (name, line)
        saved = yaml.safe_load((root / name / "config.yaml").read_text())
        assert saved["train"]["steps"] == schedule["steps"]
        assert saved["optimizer"]["lr"] == schedule.get("lr", 1e-3)
        assert saved["optimizer"]["min_lr"] == schedule.get("min_lr", 1e-4)


@pytest.mark.slow
def test_killed_at_any_point_of_the_commit_restarts_from_the_newest_complete(chain):
    """Each kill leaves what a real kill leaves on disk; the same command then continues from the newest
    complete checkpoint, and the run ends as if nothing happened (one metrics line per step)."""
    root, results, log = chain
    for name, where in (("extend", "after writing"), ("schedule", "after writing"), ("lr", "while pruning")):
        assert results[name]["error"].startswith(f"SimulatedKill: killed {where}"), results[name]
    # After run_config.yaml, before the tracker: iter 4 is complete, the tracker still names 2.
    assert _ok(results, "extend_again") == {"reason": "completed", "step": 4, "consumed_samples": 16}
    extend = root / "extend/checkpoints"
    assert (f"[pretrain] the commit of {extend}/iter_0000004 was interrupted after it was complete: "
            "latest_checkpointed_iteration.txt moved to 4") in log
    assert f"resumed from {extend}/iter_0000004 at step 4" in log
    # After the tracker, before the journal was removed: the tracker is right; the journal is dropped.
    assert _ok(results, "schedule_again")["step"] == 5
    assert f"resumed from {root}/schedule/checkpoints/iter_0000004 at step 4" in log
    # While pruning: iter 2 lost its run_config.yaml first, so it is a partial save, never "complete".
    assert _ok(results, "lr_again")["step"] == 4
    assert not (root / "lr/checkpoints/iter_0000002/run_config.yaml").exists()
    for name in ("extend", "schedule", "lr"):
        run_dir = root / name
        assert not (run_dir / "checkpoints/commit_in_progress.txt").exists(), name
        steps = [m["step"] for m in metrics(run_dir) if "loss" in m]
        assert steps == list(range(1, len(steps) + 1)), (name, steps)
        assert [m["consumed_samples"] for m in metrics(run_dir) if "loss" in m] == [4 * s for s in steps]
    assert _tracker(root / "extend") == "4" and _tracker(root / "schedule") == "5" and _tracker(root / "lr") == "4"


@pytest.mark.slow
def test_pretrained_uncommitted_checkpoint_refused(chain):
    root, results, _ = chain
    err = results["pretrained_partial"]["error"]
    assert err.startswith("ValidationFailed") and (
        f"checkpoint.pretrained: {root}/lr/checkpoints/iter_0000002: an incomplete checkpoint (no run_config.yaml: "
        "its save never committed)") in err, err


@pytest.mark.slow
def test_smaller_global_batch_continues_consumed_samples(chain):
    root, results, log = chain
    assert _ok(results, "smaller_batch") == {"reason": "completed", "step": 3, "consumed_samples": 10}
    assert "resume: train.global_batch_size 4 → 2 (consumed_samples continues" in log
    assert [m["consumed_samples"] for m in metrics(root / "smaller_batch") if "loss" in m] == [4, 8, 10]


@pytest.mark.slow
def test_another_tokenizer_refused_naming_both(chain):
    root, results, log = chain
    err = results["tokenizer_same_size"]["error"]
    path = root / "tokenizer_same_size/checkpoints/iter_0000002"
    assert re.fullmatch(
        re.escape(f"CheckpointError: {path}: cannot resume with another tokenizer: the checkpoint was trained with "
                  "sentencepiece tokenizer.model (sha256 ") + r"[0-9a-f]{12}" + re.escape(
                      ", vocabulary 32,000, EOD 2), this run's is sentencepiece other.model (sha256 ") + r"[0-9a-f]{12}"
        + re.escape(f", vocabulary 32,000, EOD 2) (data.tokenizer_model null → {root}/other.model); the embedding "
                    "rows belong to the checkpoint's tokenizer. Use it, or start a new run.dir with "
                    f"checkpoint.pretrained={path}"), err), err
    assert not (root / "tokenizer_same_size/config.yaml").exists()  # refused before anything loaded
    err = results["tokenizer_type"]["error"]
    assert err.startswith(f"CheckpointError: {root}/tokenizer_type/checkpoints/iter_0000002: cannot resume with "
                          "another tokenizer: the checkpoint was trained with sentencepiece tokenizer.model"), err
    assert "this run's is bpe-pair vocab.json + merges.txt (sha256 " in err, err
    assert "(data.tokenizer_type sentencepiece → GPT2BPETokenizer)" in err, err
    # The same tokenizer file at another path is the same tokenizer.
    assert _ok(results, "tokenizer_copy")["step"] == 2
    assert f"resume: data.tokenizer_model null → {root}/copy.model (the same tokenizer: sentencepiece copy.model" in log


@pytest.mark.slow
def test_another_model_refused_naming_each_key(chain):
    root, results, _ = chain
    path = root / "model_changed/checkpoints/iter_0000002"
    assert results["model_changed"]["error"] == (
        f"CheckpointError: {path}: cannot resume with model.normalization RMSNorm → LayerNorm, model.activation "
        "silu → gelu: these must match the checkpoint (the model's identity and its tokenizer; docs/checkpoints.md, "
        f"Resuming). To train a changed model from these weights, start a new run.dir with "
        f"checkpoint.pretrained={path}")


@pytest.mark.slow
def test_killed_async_writer_one_line(chain):
    root, results, _ = chain
    err = results["writer_killed"]["error"]
    path = root / "writer_killed/checkpoints/iter_0000003"
    assert re.fullmatch(re.escape(f"CheckpointError: {path}: saving the checkpoint failed: the asynchronous "
                                  "checkpoint writer (pid ") + r"\d+" + re.escape(
        ") was killed by SIGKILL before it finished; nothing was committed; the newest complete checkpoint is "
        "still iter_0000002"), err), err
    assert _tracker(root / "writer_killed") == "2" and not path.exists()


@pytest.mark.slow
def test_checkpoint_without_tokenizer_record_compared_by_its_config(chain):
    """Checkpoints written before the tokenizer identity was recorded: compared with the files their
    run_config.yaml names (a one-line note says so)."""
    from pretrain.checkpoint.contract import check_resume
    from pretrain.checkpoint.format import CheckpointError, inspect_checkpoint
    from pretrain.config import load_config

    root, _, _ = chain
    path = root / "base/checkpoints/iter_0000002"
    common = {k: v for k, v in inspect_checkpoint(path)[0].items() if k != "tokenizer"}
    cfg = load_config("tiny_llama", BASE + ["train.steps=3", f"run.dir={root}/base"])
    lines = check_resume(cfg, path, common)
    assert lines == ["resume: note: the checkpoint records no tokenizer identity (written before they were "
                     "recorded): compared with the tokenizer its run_config.yaml names",
                     "resume: train.steps 2 → 3 (the run ends there; with optimizer.decay_steps null the LR decay "
                     "is re-derived over it)"]
    cfg = load_config("tiny_llama", BASE + [f"data.tokenizer_model={root}/other.model", f"run.dir={root}/base"])
    with pytest.raises(CheckpointError, match="cannot resume with another tokenizer"):
        check_resume(cfg, path, common)
