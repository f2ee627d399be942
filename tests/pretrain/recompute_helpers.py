"""Shared by the recompute tests: train each case, measure the bytes held for backward, and the planner's saving."""

from __future__ import annotations

import json
from pathlib import Path

from tests.pool import run_case
from tests.pretrain.ckpt_helpers import SMALL, log_text

SHAPE = ["data.mock=true", "model.vocab_size=4096", "model.seq_length=128", "train.micro_batch_size=2"]


def train_and_measure(tmp: Path, config: str, cases: dict[str, list[str]]) -> dict:
    """Train 3 steps per case (one pool case: run dirs `tmp/<case>`), then count each case's bytes held for backward
    in one forward (`tests/pretrain/recompute_worker.py`). Returns the worker's results by case name."""
    trainer = [{"config": config, "overrides": SMALL + ["train.steps=3", "checkpoint.interval=null",
                                                       "checkpoint.save_at_end=false", f"run.dir={tmp / n}", *extra]}
               for n, extra in cases.items()]
    held = [{"name": n, "config": config,
             "overrides": SHAPE + ["train.global_batch_size=2", f"run.dir={tmp / 'held'}", *extra]}
            for n, extra in cases.items()]
    (tmp / "trainer.json").write_text(json.dumps(trainer))
    (tmp / "held.json").write_text(json.dumps(held))
    rc = run_case(1, "tests.pretrain.layout_worker", [str(tmp / "trainer.json")], tmp / "train.log", timeout=600)
    assert rc == 0, log_text(tmp / "train.log")[-3000:]
    rc = run_case(1, "tests.pretrain.recompute_worker", [str(tmp / "held.json"), str(tmp / "held_out.json")],
                  tmp / "held.log", timeout=600)
    assert rc == 0, log_text(tmp / "held.log")[-3000:]
    return json.loads((tmp / "held_out.json").read_text())


def planned_layer_saving(config: str, overrides: list[str]) -> int:
    """The planner's bytes per decoder layer and microbatch without recompute minus with this config's modules."""
    from pretrain.config import load_config
    from pretrain.layout import derive_layout
    from pretrain.planner.activations import layer_activation_bytes, recomputed_modules

    cfg = load_config(config, SHAPE + overrides)
    lay = derive_layout(cfg, 1, vocab_size=4096, on_gpu=False, te=False)
    return layer_activation_bytes(cfg, lay) - layer_activation_bytes(cfg, lay, modules=recomputed_modules(cfg.model))


def check_saving(name: str, held: dict, planned: int) -> None:
    """The bytes `name` saves against no recompute equal the planner's prediction within 1%."""
    saved = held["none"]["held_bytes"] - held[name]["held_bytes"]
    print(f"{name}: held {held[name]['held_bytes']:,} B vs {held['none']['held_bytes']:,} B without recompute: "
          f"saves {saved:,} B; planner {planned:,} B ({(saved - planned) / planned:+.2%})")
    assert saved > 0
    assert abs(saved - planned) <= 0.01 * planned
