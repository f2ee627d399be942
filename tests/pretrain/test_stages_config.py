"""Stages from the config alone (in process): each refusal one problem naming its stage (`validate`, exit 2), the
shipped example validated at its world size on mock data and planned stage by stage, the ramp's batches against
Megatron-Core's calculator, the first stage's config = the plain config, the boundary checkpoints kept by the
pruning, a moved stage refused on resume, the stage in metrics.jsonl / TensorBoard / the sinks and in `report`.
The runs themselves: `test_stages.py`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pretrain.__main__ import main as cli
from pretrain.config import load_config

BASE = {"model": {"preset": "tiny_llama", "num_layers": 2, "seq_length": 64, "vocab_size": 4096},
        "data": {"mock": True}, "train": {"global_batch_size": 4, "micro_batch_size": 1}}
GOOD = [{"name": "pretrain", "steps": 4}, {"name": "anneal", "steps": 2, "set": {"optimizer.lr": 1e-4}}]


def write(tmp_path: Path, stages: list, **sections) -> Path:
    cfg = {**json.loads(json.dumps(BASE)), "stages": stages}
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    path = tmp_path / "staged.yaml"
    path.write_text(json.dumps(cfg))
    return path


REFUSALS = {
    "empty name": ([{"name": "", "steps": 2}], {}, "stages[0]: a stage needs a name"),
    "duplicate name": ([{"name": "a", "steps": 2}, {"name": "a", "steps": 2}], {},
                       "stage 'a': the name 'a' is used by an earlier stage"),
    "zero steps": ([{"name": "a", "steps": 0}], {}, "stage 'a': steps=0 must be a positive whole number"),
    "shape key": ([*GOOD, {"name": "wide", "steps": 1, "set": {"model.hidden_size": 512}}], {},
                  "stage 'wide': a stage cannot set model.hidden_size: the model's identity"),
    "tokenizer key": ([*GOOD, {"name": "tok", "steps": 1, "set": {"data.tokenizer_type": "GPT2BPETokenizer"}}], {},
                      "stage 'tok': a stage cannot set data.tokenizer_type: the tokenizer"),
    "vocabulary": ([*GOOD, {"name": "voc", "steps": 1, "set": {"model.vocab_size": 8192}}], {},
                   "stage 'voc': a stage cannot set model.vocab_size"),
    "initial value after the first stage": (
        [*GOOD, {"name": "init", "steps": 1, "set": {"model.init_method_std": 0.01}}], {},
        "stage 'init': a stage after the first cannot set model.init_method_std: it starts from the previous stage's "
        "checkpoint, and model.init_method_std is not used on resume (the weights come from the checkpoint)"),
    "unknown key": ([*GOOD, {"name": "long", "steps": 1, "set": {"model.seq_lenght": 128}}], {},
                    "stage 'long': unknown config key 'model.seq_lenght' (did you mean 'model.seq_length'?)"),
    "tokens not a multiple": ([{"name": "a", "tokens": 1000}], {},
                              "stage 'a': tokens=1,000 is no whole number of steps (global batch 4 × sequence 64): it "
                              "falls between 3 step(s) (768 tokens) and 4 step(s) (1,024 tokens)"),
    "conflicting train.steps": (GOOD, {"train": {"steps": 100}},
                                "[train.steps] train.steps=100 conflicts with the stages, whose steps add up to 6"),
    "sequence change without keep": ([*GOOD, {"name": "long", "steps": 1, "set": {"model.seq_length": 128}}], {},
                                     "stage 'long': model.seq_length changes 64 → 128: say whether the batch keeps its "
                                     "256 tokens (keep: tokens) or its 4 samples, 512 tokens (keep: samples)"),
    "ramp not dividing DP": (GOOD, {"train": {"rampup_batch_size": [1, 1, 4]}},
                             "stage 'pretrain': the ramp's global batch of 1 samples (of 1, 2, 4 in steps 1-4) does "
                             "not divide into micro batch 1 × DP 2"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_with_one_line_naming_the_stage(case, tmp_path, capsys):
    stages, sections, line = REFUSALS[case]
    rc = cli(["validate", str(write(tmp_path, stages, **sections)), "--world-size", "2"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "config check failed: 1 problem(s)" in err and line in err, err


def test_a_blend_missing_in_a_later_stage_is_refused_before_the_first_step(tmp_path, capsys, small_datasets):
    """Every stage's dataset files are checked by `validate` (and by the trainer before step 1)."""
    stages = [*GOOD, {"name": "hq", "steps": 1, "set": {"data.blend": [str(tmp_path / "gone_text_document")]}}]
    path = write(tmp_path, stages, data={"mock": False, "blend": [small_datasets["a"]]}, model={"vocab_size": None})
    assert cli(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "1 problem(s)" in err and "stage 'hq': " in err and "gone_text_document" in err, err


def test_validate_checks_every_stage_at_once(tmp_path, capsys):
    """Problems of several stages (a layout one among them) in one report, each naming its stage."""
    stages = [{"name": "a", "steps": 2}, {"name": "b", "steps": 2, "set": {"parallel.tensor": 4}},
              {"name": "c", "steps": 2, "set": {"model.hidden_sizee": 1}}]
    assert cli(["validate", str(write(tmp_path, stages)), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "stage 'c': unknown config key" in err, err
    assert "stage 'b': " in err and "parallel.tensor" in err, err  # TP4 on 2 ranks
    assert "stage 'a'" not in err and "every stage" not in err.split("note:")[0], err


def test_the_example_validates_at_its_world_size_and_plans_each_stage(capsys):
    """llama3_8b_staged: 3 stages checked as on 256 GPUs on mock data (the planner's check: its data lives
    elsewhere), and `plan`'s stage table: steps, tokens (by hand), layout, and the run's GPU-hours."""
    from pretrain.stages.plan import resolve_run

    cfg = load_config("llama3_8b_staged", ["data.mock=true"])
    staged = resolve_run(cfg, 256, files=False, gpu_dry_run=True, cuda_available=False)
    assert staged.report().ok, staged.report().text()
    assert [s.name for s in staged.stages] == ["pretrain", "anneal", "long"]
    long = staged.stages[2].cfg
    assert (long.model.seq_length, long.train.global_batch_size, long.parallel.context) == (32768, 128, 8)
    assert long.model.rope_scaling and long.model.rope_scaling_factor == 8.0
    assert cli(["plan", "llama3_8b_staged", "--nodes", "32", "--gpus-per-node", "8", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    rows = table["stages"]
    assert [(r["name"], r["first_step"], r["last_step"]) for r in rows] == [
        ("pretrain", 1, 3_500_000), ("anneal", 3_500_001, 3_512_000), ("long", 3_512_001, 3_514_000)]
    assert [r["tokens"] for r in rows] == [3_500_000 * 512 * 8192, 50_331_648_000, 2000 * 128 * 32768]
    assert [r["layout"] for r in rows] == ["TP1 PP1 CP2 p2p DP128"] * 2 + ["TP1 PP1 CP8 p2p DP32"]
    assert all(r["fits"] for r in rows)
    assert table["total"]["gpu_hours"] == pytest.approx(sum(r["gpu_hours"] for r in rows))
    for r in rows:  # each stage's time: its full plan's step time (`--stage NAME`) over its steps
        assert cli(["plan", "llama3_8b_staged", "--nodes", "32", "--gpus-per-node", "8", "--json",
                    "--stage", r["name"]]) == 0
        step_s = json.loads(capsys.readouterr().out)["cost_model"]["step_s"]
        assert r["gpu_hours"] == pytest.approx(step_s * r["steps"] / 3600 * 256)
    assert cli(["plan", "llama3_8b_staged", "--nodes", "32", "--gpus-per-node", "8"]) == 0
    print(capsys.readouterr().out)


def _documented_ramp(ramp: list[int], gbs: int, consumed: int) -> int:
    """Megatron-Core's ramp as its RampupBatchsizeNumMicroBatchesCalculator computes it (0.16's source)."""
    start, increment, samples = ramp
    if consumed > samples:
        return gbs
    return start + int(consumed / (samples / ((gbs - start) // increment))) * increment


@pytest.mark.mcore
def test_the_ramp_is_megatrons_calculator_step_by_step():
    """The batches the stages walk (and the 0.19 step schedule they are handed as) = Megatron-Core's calculator:
    its class where the release has it, its documented arithmetic otherwise; a stage in tokens during the ramp."""
    from megatron.core import num_microbatches_calculator as calc

    from pretrain.stages.samples import walk

    rng = random.Random(7)
    for _ in range(40):
        start, inc, n = rng.randint(1, 40), rng.randint(1, 24), rng.randint(1, 12)
        gbs, samples = start + n * inc, rng.randint(1, 3000)
        ramp, consumed, want = [start, inc, samples], 0, []
        reference = (calc.RampupBatchsizeNumMicroBatchesCalculator(gbs, 1, 1, False, -1, *ramp)
                     if hasattr(calc, "RampupBatchsizeNumMicroBatchesCalculator") else None)
        for _step in range(60):
            if reference is not None:
                reference.update(consumed, False)
                assert reference.get_current_global_batch_size() == _documented_ramp(ramp, gbs, consumed)
            want.append(_documented_ramp(ramp, gbs, consumed))
            consumed += want[-1]
        for k in (1, 7, 60):
            got = walk(ramp, gbs, 0, 16, steps=k)
            assert (got.samples, got.batch_sizes) == (sum(want[:k]), tuple(sorted(set(want[:k])))), (ramp, gbs, k)
        assert walk(ramp, gbs, 0, 16, tokens=16 * sum(want[:9])).steps == 9


def test_docs_stage_table_is_what_plan_prints(capsys):
    """docs/training.md shows `plan llama3_8b_staged --nodes 32 --gpus-per-node 8`'s stage table: it is what the
    command prints now (a planner change updates the docs)."""
    from pathlib import Path

    assert cli(["plan", "llama3_8b_staged", "--nodes", "32", "--gpus-per-node", "8"]) == 0
    printed = capsys.readouterr().out.splitlines()
    docs = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    start = docs.index("plan: llama3_8b_staged on 32 node(s)")
    shown = docs[start:docs.index("```", start)].rstrip("\n").splitlines()
    assert shown == printed[:len(shown)], "\n".join(printed[:len(shown)])


def test_plan_shows_the_ramp(capsys):
    """[2, 2, 40] to 8: 2 while consumed < 40/3 (7 steps), 4 to 26 (4 more), 6 to 42 (2 more), then 8 (by hand)."""
    assert cli(["plan", "tiny_llama", "train.rampup_batch_size=[2,2,40]", "--nodes", "1", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "global batch 2, 4, 6, 8 (Megatron-Core's calculator); the target from step 14 (42 samples before it)" in out


def test_the_first_stage_is_the_plain_config(tmp_path):
    """The first stage's config is the config with its set and the run's length (no stages); later stages add
    their own set to the one before (keep: tokens rescales the batch)."""
    from pretrain.stages.spec import derive

    stages = [{"name": "a", "steps": 3, "set": {"optimizer.lr": 2e-3}}, {"name": "b", "tokens": 512},
              {"name": "c", "steps": 1, "keep": "tokens", "set": {"model.seq_length": 128}}]
    spec = derive(load_config(write(tmp_path, stages)))
    plain = load_config(write(tmp_path, []), ["optimizer.lr=2e-3", "train.steps=6", "stages=null"])
    assert spec.stages[0].cfg.to_dict() == plain.to_dict()
    assert [(s.start_step, s.steps, s.first_sample) for s in spec.stages] == [(0, 3, 0), (3, 2, 12), (5, 1, 20)]
    assert spec.stages[1].cfg.optimizer.lr == 2e-3 and spec.stages[2].cfg.train.global_batch_size == 2


def test_boundary_checkpoints_outlive_keep_last(tmp_path):
    from pretrain.checkpoint.format import RUN_CONFIG_FILE, iteration_dir, name_checkpoint
    from pretrain.checkpoint.save import _prune

    for step in (2, 4, 5, 6, 8):
        iteration_dir(tmp_path, step).mkdir()
        (iteration_dir(tmp_path, step) / RUN_CONFIG_FILE).write_text("{}")
    link = name_checkpoint(tmp_path, 5, "pretrain")
    assert name_checkpoint(tmp_path, 5, "pretrain") == link and link.resolve() == iteration_dir(tmp_path, 5)
    _prune(tmp_path, keep_last=1, current=8)
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000005", "iter_0000008"]


def test_a_stage_that_started_cannot_move(tmp_path, monkeypatch):
    """Resuming mid-stage where the checkpoint's record names another stage (the config moved it) is refused."""
    import pretrain.stages.boundaries as boundaries
    from pretrain.checkpoint.format import CheckpointError
    from pretrain.stages.plan import resolve_run

    staged = resolve_run(load_config(write(tmp_path, GOOD)), 1, files=False)
    saved = {boundaries.STAGE_STATE: {"name": "pretrain", "start_step": 0, "first_sample": 0}}
    anneal = staged.stages[1]
    assert boundaries.enter(staged, anneal, 4, 16, saved, print) == 16  # its first step: the checkpoint's count
    with pytest.raises(CheckpointError, match="written in stage 'pretrain' .* puts step 6 in stage 'anneal'"):
        boundaries.enter(staged, anneal, 5, 20, saved, print)
    boundaries.leave()


def test_the_stage_reaches_metrics_tensorboard_and_the_sinks(tmp_path):
    from pretrain.observe.metrics import MetricsWriter

    class Sink:
        def __init__(self):
            self.rows = []

        def log(self, step, values):
            self.rows.append((step, values.get("train/stage"), values.get("train/stage_index")))

        def close(self):
            pass

    sink = Sink()
    writer = MetricsWriter(tmp_path, tensorboard=True, sinks=[sink])
    for step, stage, index in ((1, "pretrain", 0), (2, "pretrain", 0), (3, "anneal", 1)):
        writer.write({"step": step, "loss": 1.0, "stage": stage, "stage_index": index})
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["stage"] for line in lines] == ["pretrain", "pretrain", "anneal"]
    assert sink.rows == [(1, "pretrain", 0), (2, "pretrain", 0), (3, "anneal", 1)]
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/stage_index")] == [(1, 0), (2, 0), (3, 1)]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors("train/stage/text_summary")]
    assert texts == [(1, "pretrain"), (3, "anneal")]


def test_report_marks_the_stage_boundaries(tmp_path, monkeypatch):
    import matplotlib.axes

    from pretrain.observe import report

    run = tmp_path / "run"
    run.mkdir()
    stages = ["pretrain"] * 3 + ["anneal"] * 2 + ["long"] * 2
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s_per_gpu": 10.0,
                    "stage": name}) + "\n" for s, name in enumerate(stages, 1)))
    lines = []
    real = matplotlib.axes.Axes.axvline
    monkeypatch.setattr(matplotlib.axes.Axes, "axvline", lambda ax, x=0, *a, **k: lines.append(x) or real(ax, x, *a,
                                                                                                            **k))
    assert report.main([str(run)]) == 0
    assert sorted(set(lines)) == [3.5, 5.5] and len(lines) == 2 * 4  # before steps 4 and 6, on every panel
    assert (run / "report.png").stat().st_size > 10_000


def test_wandb_carries_the_stage_name(tmp_path):
    """W&B (offline) gets `train/stage` (the name) and `train/stage_index` with every step's scalars, read back with
    wandb's own transaction-log reader."""
    pytest.importorskip("wandb")
    import subprocess
    import sys

    from pretrain.observe.metrics import MetricsWriter
    from pretrain.observe.wandb_logger import wandb_sinks

    cfg = load_config("tiny_llama", [f"run.dir={tmp_path}", "logging.wandb.project=stages-test",
                                     "logging.wandb.mode=offline"])
    writer = MetricsWriter(tmp_path, tensorboard=False, sinks=wandb_sinks(cfg))
    for step, stage in ((1, "pretrain"), (2, "anneal")):
        writer.write({"step": step, "loss": 1.0 / step, "stage": stage, "stage_index": step - 1})
    writer.close()
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect", str(log), "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [json.loads(line)["history"]["item"] for line in out.splitlines() if json.loads(line)["type"] == "history"]
    assert [(r["train/stage"], r["train/stage_index"]) for r in rows] == [("pretrain", 0), ("anneal", 1)]
