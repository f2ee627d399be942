"""Sharded preprocessing without a cluster (the Slurm path: tests/launch/test_slurm.py): the byte-balanced plan,
each task's part, and the final step — merged bytes equal one `preprocess` of the same files, the blend lists
only verified parts weighted by tokens, and a missing or interrupted part is refused, naming its task's files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import data_tools.preprocess as pp
from data_tools.__main__ import main
from data_tools.shards import plan_shards, read_plan, run_task

from .conftest import SP_ARGS, corpus_texts, write_jsonl

# The reference encoder: no gigatoken probe at each start (the ids are the same).
SP = ["--tokenizer-type", "sentencepiece", "--tokenizer-model", SP_ARGS["tokenizer_model"], "--encoder", "reference"]


@pytest.mark.parametrize("sizes,tasks", [([5] * 10, 3), ([100, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2),
                                         ([1, 2, 3, 50, 3, 2, 1, 40, 1], 4), ([7], 3), ([0, 0, 0, 0], 2)])
def test_plan_is_contiguous_balanced_and_deterministic(sizes, tasks):
    shards = plan_shards(sizes, tasks)
    assert shards == plan_shards(list(sizes), tasks)  # deterministic
    assert shards[0][0] == 0 and shards[-1][1] == len(sizes) and len(shards) <= tasks
    assert all(a[1] == b[0] for a, b in zip(shards, shards[1:]))  # contiguous, in order: merging keeps the order
    assert all(end > first for first, end in shards)  # never an empty task
    target, biggest = sum(sizes) / tasks, max(sizes)
    assert all(abs(sum(sizes[f:e]) - target) <= biggest for f, e in shards)  # within one file of the mean


def _corpus(root: Path) -> Path:
    texts = corpus_texts(30, 2500)
    (root / "in").mkdir()
    for i, n in enumerate((3, 9, 4, 8, 6)):  # uneven files
        write_jsonl(root / "in" / f"f{i}.jsonl", texts[:n])
        texts = texts[n:]
    return root / "in"


def test_parts_merge_to_the_single_process_bytes_and_blend_only_verified_parts(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    (tmp_path / "out").mkdir()
    prefix = tmp_path / "out" / "web"
    args = ["--input", str(corpus), "--output-prefix", str(prefix), *SP, "--append-eod", "--batch-mb", "0.01"]
    assert main(["shard-plan", "--tasks", "3", "--", *args]) == 0
    plan_file, n = capsys.readouterr().out.split()
    plan = read_plan(plan_file)
    assert n == "3" and [len(plan.files(t)) for t in range(3)] == [2, 2, 1]
    say = []
    run_task(plan, 0, say.append)

    # Task 1 interrupted after its first batch; task 2 not run: the final step refuses, naming both.
    real = pp._write_state

    def interrupt(path, state):
        real(path, state)
        raise KeyboardInterrupt

    pp._write_state = interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            run_task(plan, 1, say.append)
    finally:
        pp._write_state = real
    assert main(["finalize", plan_file, "--mode", "blend"]) == 1
    err = capsys.readouterr().err
    assert "2 of 3 task(s) have no complete part, so nothing was blended" in err, err
    assert f"task 1 of 3 (2 file(s), {plan.task_bytes(1):,} bytes: {corpus}/f2.jsonl, {corpus}/f3.jsonl): " \
           "interrupted (its resume state is there" in err, err
    assert f"task 2 of 3 (1 file(s), {plan.task_bytes(2):,} bytes: {corpus}/f4.jsonl): not written" in err, err
    assert not list(tmp_path.glob("out/*.blend"))

    assert "done (resumed)" in run_task(plan, 1, say.append)  # the requeued task continues its share
    run_task(plan, 2, say.append)
    assert "already complete" in run_task(plan, 2, say.append)
    assert main(["finalize", plan_file, "--mode", "blend"]) == 0
    line = (tmp_path / "out" / "web_text_document.blend").read_text().strip()
    tokens = [json.loads(Path(f"{plan.part(t, 'text')}.meta.json").read_text())["tokens"] for t in range(3)]
    assert line == "data.blend=[" + ",".join(f"{n},{plan.part(t, 'text')}" for t, n in enumerate(tokens)) + "]"

    assert main(["finalize", plan_file, "--mode", "merge", "--remove-parts"]) == 0
    pp.preprocess([str(corpus)], str(tmp_path / "single"), append_eod=True, encoder="reference", **SP_ARGS)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"out/web_text_document.{ext}").read_bytes() == \
            (tmp_path / f"single_text_document.{ext}").read_bytes(), ext
    merged, single = (json.loads((tmp_path / f"{p}_text_document.meta.json").read_text())
                      for p in ("out/web", "single"))
    same = ("tokenizer", "append_eod", "dtype", "documents", "sequences", "tokens", "max_token_id")
    assert {k: merged[k] for k in same} == {k: single[k] for k in same}
    assert merged["index"]["fingerprint"] == single["index"]["fingerprint"]  # the same .idx
    assert not list(tmp_path.glob("out/web_part*"))  # --remove-parts


def test_a_second_run_of_a_task_is_refused_while_the_first_holds_its_part(tmp_path, capsys):
    """Each task locks its own part (`PREFIX_partKKKKK.lock`, as preprocess locks its prefix): a second
    `shard-run` of the same task (a duplicate submission) is refused naming the holder and writes nothing; the
    other tasks' parts are not locked by it."""
    import os
    import subprocess
    import sys

    from data_tools.shards import task_targets
    from pretrain.run.output_lock import hold

    corpus = _corpus(tmp_path)
    (tmp_path / "out").mkdir()
    prefix = tmp_path / "out" / "web"
    args = ["--input", str(corpus), "--output-prefix", str(prefix), *SP, "--append-eod"]
    assert main(["shard-plan", "--tasks", "3", "--", *args]) == 0
    plan_file = capsys.readouterr().out.split()[0]
    plan = read_plan(plan_file)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with hold(task_targets(plan, 1)):
        done = subprocess.run([sys.executable, "-m", "data_tools", "shard-run", plan_file, "--task", "1"],
                              capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert "is in use by another writer" in line and f"pid {os.getpid()}" in line, line
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["web.shards.json"]


def test_a_part_made_with_other_options_is_redone_and_refused_by_finalize(tmp_path, capsys):
    """Every option that changes a part's bytes is part of its identity: a new plan into the same prefix with
    another tokenizer or without --append-eod redoes the parts made otherwise (one note each, naming the
    option), and `finalize` refuses a part that does not match its plan, naming the part and the option."""
    corpus = tmp_path / "in"
    corpus.mkdir()
    texts = corpus_texts(6, 400)
    for i in range(2):
        write_jsonl(corpus / f"f{i}.jsonl", texts[3 * i:3 * i + 3])
    (tmp_path / "out").mkdir()
    base = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out" / "web"), "--encoder", "reference"]

    def plan(*opts: str) -> str:
        assert main(["shard-plan", "--tasks", "2", "--", *base, *opts]) == 0
        return capsys.readouterr().out.split()[0]

    def run(plan_file: str, task: int) -> tuple[str, str]:
        assert main(["shard-run", plan_file, "--task", str(task)]) == 0
        got = capsys.readouterr()
        return got.out, got.err

    sp = plan(*SP[:4], "--append-eod")
    run(sp, 0), run(sp, 1)
    gpt2 = plan("--tokenizer-type", "GPT2BPETokenizer", "--append-eod")  # the embedded GPT-2 files
    out, err = run(gpt2, 0)
    assert "already complete" not in out and "was made with other options than the plan's (tokenizer: the " \
           "part's sentencepiece tokenizer.model" in err and "redoing it" in err, out + err
    assert main(["finalize", gpt2, "--mode", "blend"]) == 1
    err = capsys.readouterr().err
    part1 = read_plan(gpt2).part(1, "text")
    assert f"part {part1} was made with other options than the plan's (tokenizer: the part's sentencepiece " \
           "tokenizer.model" in err and "the plan's bpe-pair" in err, err
    assert not list(tmp_path.glob("out/*.blend"))

    no_eod = plan(*SP[:4])
    out, err = run(no_eod, 1)
    assert "(append_eod: the part's True, the plan's False)" in err and "already complete" not in out, out + err
    assert main(["finalize", no_eod, "--mode", "merge"]) == 1
    err = capsys.readouterr().err
    assert f"part {read_plan(no_eod).part(0, 'text')} was made with other options" in err and "tokenizer: " in err \
           and "append_eod: the part's True, the plan's False" in err, err
    assert not list(tmp_path.glob("out/web_text_document.*"))
    run(no_eod, 0)
    assert main(["finalize", no_eod, "--mode", "merge"]) == 0
    merged = json.loads((tmp_path / "out" / "web_text_document.meta.json").read_text())
    assert merged["append_eod"] is False and merged["tokenizer"]["kind"] == "sentencepiece"


def test_a_blend_of_more_parts_than_megatron_indexes_is_refused_first(tmp_path, capsys):
    """Megatron-Core's BlendedDataset keeps each sample's dataset as int16: `finalize --mode blend` of 32,769 parts
    is refused with that reason before any part is looked at (merge is the way)."""
    from data_tools.shards import Plan

    n = 2**15 + 1
    plan = Plan(str(tmp_path / "web"), [{"path": f"/x/{i}.jsonl", "bytes": 1} for i in range(n)],
                [(i, i + 1) for i in range(n)], {})
    (tmp_path / "plan.json").write_text(plan.to_json())
    assert main(["finalize", str(tmp_path / "plan.json"), "--mode", "blend"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --mode blend of 32,769 parts: Megatron-Core's blend indexes its datasets as int16, at most "
                   "32,768; use --mode merge"], err
