"""The run is resolved once (`pretrain.run_plan`): one layout and one tokenizer resolution per process for a
training run, a resumed one included, at DP2 through the CLI, and for `validate`, `plan` and `convert to-hf` of
that run's checkpoint (in this process); and an observer registered in
`pretrain.observe.observers.INSTRUMENTS` is told of every step, checkpoint and the exit, with no edit of the loop."""

from __future__ import annotations

import json

import pytest

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import log_text

pytestmark = [pytest.mark.slow, pytest.mark.mcore]


def test_layout_and_tokenizer_are_resolved_once_per_process(tmp_path):
    run = tmp_path / "run"
    common = ["tiny_llama", f"run.dir={run}", "train.global_batch_size=4", "train.micro_batch_size=1",
              "model.num_layers=2", "model.seq_length=64"]
    cases = {"fresh": ["train", *common, "train.steps=2"], "resumed": ["train", *common, "train.steps=3"]}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    rc = run_case(2, "tests.pretrain.run_plan_worker", [str(tmp_path / "cases.json"), str(tmp_path)],
                  tmp_path / "worker.log", timeout=600)
    assert rc == 0, log_text(tmp_path / "worker.log")[-4000:]
    assert "resumed from" in log_text(tmp_path / "worker.log")
    for name in cases:
        for rank in (0, 1):
            got = json.loads((tmp_path / f"{name}.rank-{rank}.json").read_text())
            assert got["rc"] == 0 and got["resolutions"] == {"layout": 1, "tokenizer": 1}, (name, rank, got)
            steps = [1, 2] if name == "fresh" else [3]
            expected = [e for s in steps for e in (["start", s], ["end", s, []])]
            expected += [["checkpoint", steps[-1], f"iter_{steps[-1]:07d}"], ["close", steps[-1]]]
            assert got["events"] == expected, (name, rank, got["events"])
    assert resolutions_of_the_other_commands(run, common, tmp_path / "hf") == {
        "validate": {"layout": 1, "tokenizer": 1}, "plan": {"layout": 1, "tokenizer": 1},
        # The export reads layout-independent storage keys: no layout; the tokenizer only for the vocabulary.
        "to-hf": {"tokenizer": 1}}


def resolutions_of_the_other_commands(run, common: list[str], hf_dir) -> dict:
    """{command: pretrain.layout.RESOLUTIONS after it} for validate, plan and convert to-hf, each through its CLI."""
    from data_tools.convert import main as convert
    from pretrain.__main__ import main as cli
    from pretrain.layout import RESOLUTIONS

    commands = {"validate": lambda: cli(["validate", *common]),
                "plan": lambda: cli(["plan", *common, "--nodes", "1", "--gpus-per-node", "2"]),
                "to-hf": lambda: convert(["to-hf", "--checkpoint", str(run), "--output", str(hf_dir), "--no-progress"])}
    counts = {}
    for name, command in commands.items():
        RESOLUTIONS.clear()
        assert command() == 0, name
        counts[name] = dict(RESOLUTIONS)
    return counts
