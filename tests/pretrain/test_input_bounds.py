"""Inputs whose cost is not bounded by the model's size are refused (or kept compact) before anything expands them,
through `python -m pretrain validate` (in-process: `tests/cli.py`): one line naming the key, exit 2, in seconds.

The class: a layout string's repeats (`(t|)*99999999`, `t*99999999`: Megatron-Core's parser unrolls them in
memory), ranges in `train.skip_steps` (`"1-99999999999"`: once a set of every step), YAML aliases in any value (nested
`*name`s expand exponentially in every later walk: type checks, messages), a blend of more datasets than
Megatron-Core's int16 dataset index holds, and lists echoed whole in messages. Before the fix the layout and
skip-step cases never returned (or ended in a MemoryError traceback), the alias cases hung in the type check's
message."""

from __future__ import annotations

import time

import pytest
import yaml

from tests.cli import run_cli
from tests.pretrain.ckpt_helpers import REPO

# A nested YAML alias: 10 ** 8 values from 200 characters.
LAUGHS = "[&a [1,1,1,1,1,1,1,1,1,1]," + ",".join(
    f"&{b} [{','.join([f'*{a}'] * 10)}]" for a, b in zip("abcdefg", "bcdefgh")) + "]"
FAST_S = 20  # generous on a loaded machine: each case takes 1-2 s here; before the fix they never returned


def _validate(*argv: str):
    start = time.perf_counter()
    result = run_cli("pretrain", ["validate", *argv])
    return result, time.perf_counter() - start


def _one_problem(result) -> str:
    """The one problem line of a refused config (exit 2, no traceback)."""
    assert result.rc == 2 and result.traceback is None, result
    lines = [ln for ln in result.stderr.splitlines() if ln.strip().startswith("1. ")]
    assert len(lines) == 1 and "  2. " not in result.stderr, result
    return lines[0]


REFUSED = {
    "layout_group_repeat": (["tiny_deepseek", "parallel.pipeline=2", "parallel.pipeline_layout=(t|)*99999999"],
                            "parallel.pipeline_layout='(t|)*99999999' unrolls to more than 21 characters, more than "
                            "any layout of model.num_layers=4 + 1 MTP on parallel.pipeline=2 has"),
    "layout_char_repeat": (["tiny_llama", "parallel.pipeline=2", "parallel.pipeline_layout=Et*99999999|L"],
                           "parallel.pipeline_layout='Et*99999999|L' unrolls to more than 18 characters"),
    "layout_count_beyond_int": (["tiny_llama", "parallel.pipeline=2", f"parallel.pipeline_layout=(t)*{'9' * 5000}"],
                                "unrolls to more than 18 characters"),
    "layout_empty": (["tiny_llama", "parallel.pipeline=2", "parallel.pipeline_layout=''"],
                     "[parallel.pipeline_layout, parallel.pipeline, model.num_layers] parallel.pipeline_layout='' is "
                     "empty. Fix: "),
    "layout_empty_one_stage": (["tiny_llama", "parallel.pipeline_layout=','"], "parallel.pipeline_layout=',' is empty"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unbounded_layouts_are_refused_fast(name):
    argv, expected = REFUSED[name]
    result, seconds = _validate(*argv)
    line = _one_problem(result)
    print(f"{name}: exit {result.rc} in {seconds:.1f} s: {line.strip()[:200]}")
    assert expected in line, line
    assert "Megatron-Core:" not in line and len(line) < 600 and seconds < FAST_S


def test_megatron_words_follow_our_reason():
    """A layout Megatron-Core refuses: our reason first, then its own words, quoted."""
    line = _one_problem(_validate("tiny_llama", "parallel.pipeline=2", "parallel.pipeline_layout=Ettt|L")[0])
    assert ("parallel.pipeline_layout='Ettt|L' places 3 decoder layer(s) `t`, but model.num_layers=4 (Megatron-Core: "
            "\"Number of decoder layers 3must match num_layers 4\"). Fix: ") in line, line


def test_skip_step_ranges_are_kept_as_ranges():
    """A range up to step 99,999,999,999 costs what one step costs; the part beyond train.steps is a warning (kept:
    it applies if a resumed run is given more steps), and every bad entry is named at once."""
    result, seconds = _validate("tiny_llama", "data.mock=true", "train.steps=30", 'train.skip_steps=["1-99999999999"]')
    assert result.rc == 0 and seconds < FAST_S, result
    assert ("warning: train.skip_steps names steps after train.steps=30 ('1-99999999999'): this run ends at step 30, "
            "so they are never skipped here") in result.stdout, result
    bad = _one_problem(_validate("tiny_llama", 'train.skip_steps=["5-3", 0, -1, 4, "2-x"]')[0])
    assert ("[train.skip_steps] train.skip_steps entries '5-3', 0, -1, '2-x' are not steps (1 or more) or ranges "
            "\"a-b\" (1 <= a <= b)") in bad, bad


@pytest.mark.parametrize("key", ["data.blend", "model.moe_layer_freq", "train.skip_steps", "logging.profile.ranks"])
def test_yaml_aliases_cannot_expand_a_value(key):
    result, seconds = _validate("tiny_llama", f"{key}={LAUGHS}")
    assert result.rc == 2 and result.traceback is None and seconds < FAST_S, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 400, lines
    assert (f"'{key}' holds 123,456,789 values once its YAML aliases (*name) are expanded, more than any config needs "
            "(at most 1,000,000): write the values out") in lines[0], lines
    cycle = _validate("tiny_llama", f"{key}=&a [*a]")[0]
    assert cycle.rc == 2 and f"'{key}' holds a YAML alias that contains itself" in cycle.stderr, cycle


def test_blend_of_more_datasets_than_megatron_indexes(tmp_path):
    """Megatron-Core's BlendedDataset keeps each sample's dataset as int16 (a larger index would wrap and draw the
    wrong dataset): a blend of 32,769 prefixes is one line, before any of its files is looked at (before: one
    "no dataset there" line per prefix)."""
    config = yaml.safe_load((REPO / "pretrain" / "configs" / "tiny_llama.yaml").read_text())
    config["data"]["blend"] = [f"/nonexistent/p{i}" for i in range(2**15 + 1)]
    path = tmp_path / "blend.yaml"
    path.write_text(yaml.safe_dump(config))
    line = _one_problem(_validate(str(path))[0])
    assert ("[data.blend] data.blend names 32,769 datasets: Megatron-Core's blend indexes its datasets as int16, at "
            "most 32,768") in line, line


def test_profile_ranks_are_bounded_by_the_job():
    """Distinct ranks of the job: a list of ranks holds at most the world size (before: any length, echoed whole)."""
    line = _one_problem(_validate("tiny_llama", "logging.profile.start_step=1", "logging.profile.end_step=2",
                                  f"logging.profile.ranks=[{','.join(['0'] * 5000)}]")[0])
    assert ("[logging.profile.ranks] logging.profile.ranks lists 5,000 ranks, 4,999 of them more than once. Fix: list "
            "each rank once") in line, line
