"""Blends through the trainer, as users write them: the README's `data.blend=[0.7,A,0.3,B]`, `[1.0,prefix]`,
per-split blends with weights, and a blend given on a config with `data.mock: true` (the blend wins)."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.pretrain.cli_worker import run_cases

REPO = Path(__file__).resolve().parents[2]
FAST = ["checkpoint.save_at_end=false", "logging.tensorboard=false", "train.global_batch_size=8",
        "train.micro_batch_size=2"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _blend_counts(run_dir: Path, split: str) -> list[int]:
    """How many samples of each blended dataset Megatron's BlendedDataset index holds (from run.dir's cache)."""
    (path,) = glob.glob(str(run_dir / "data_cache" / f"*-BlendedDataset-{split}-dataset_index.npy"))
    return np.bincount(np.load(path)).tolist()


def test_readme_weighted_blend_trains_through_the_cli(small_datasets, tmp_path):
    """`python -m pretrain train tiny_llama 'data.blend=[0.7,A,0.3,B]'` with evaluation: both splits blend."""
    a, b = small_datasets["a"], small_datasets["b"]
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "train", "tiny_llama", f"data.blend=[0.7,{a},0.3,{b}]",
         "train.steps=2", "train.eval_interval=2", "train.eval_iters=1", f"run.dir={run_dir}", *FAST],
        cwd=REPO, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = _metrics(run_dir)
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 9 for r in records if "loss" in r)
    assert [r["step"] for r in records if "valid_loss" in r] == [2]
    # Megatron's blend sizes: ceil(16·0.7)=12 + ceil(16·0.3)=5 training samples, 6 + 3 validation samples.
    assert _blend_counts(run_dir, "train") == [12, 5]
    assert _blend_counts(run_dir, "valid") == [6, 3]


def test_blend_forms_and_mock_precedence(small_datasets, tmp_path):
    """One worker process, several CLI command lines: `[1.0, prefix]`, weighted per-split blends, and a blend
    on tiny_llama (whose YAML says `data.mock: true`) training on the blend exactly like `data.mock=false`."""
    a, b = small_datasets["a"], small_datasets["b"]
    runs = {name: tmp_path / name for name in ("single", "per_split", "mock_and_blend", "blend_only", "mock")}

    def train(name: str, *overrides: str) -> list[str]:
        return ["train", "tiny_llama", "train.steps=1", f"run.dir={runs[name]}", *FAST, *overrides]

    cases = {
        "single": train("single", f"data.blend=[1.0,{a}]"),
        "per_split": train("per_split", f"data.train_blend=[0.5,{a},0.5,{b}]", f"data.valid_blend=[1.0,{b}]",
                           "train.eval_interval=1", "train.eval_iters=1"),
        "mock_and_blend": train("mock_and_blend", f"data.blend=[{a}]"),
        "blend_only": train("blend_only", "data.mock=false", f"data.blend=[{a}]"),
        "mock": train("mock"),
    }
    results = run_cases(cases, tmp_path / "worker")
    for name, res in results.items():
        assert res["rc"] == 0 and res["traceback"] is None, (name, res)
    loss = {name: _metrics(runs[name])[0]["loss"] for name in runs}
    assert [r["step"] for r in _metrics(runs["per_split"]) if "valid_loss" in r] == [1]
    assert _blend_counts(runs["per_split"], "train") == [4, 4]
    # The blend wins over data.mock: true — same data, same loss as with data.mock=false — and says so.
    assert loss["mock_and_blend"] == loss["blend_only"] != loss["mock"]
    assert "note: data.mock=true is ignored because a blend is given" in results["mock_and_blend"]["stdout"]
    assert glob.glob(str(runs["mock_and_blend"] / "data_cache" / "*-GPTDataset-train-*"))
    assert "ignored" not in results["mock"]["stdout"]
