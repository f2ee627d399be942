"""Per-step metrics: one JSON line per step in `run.dir/metrics.jsonl`, TensorBoard scalars (and the same scalars
to any other sink, e.g. Weights & Biases), a log line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from pretrain.files import write_atomic

# One line per step, these keys first (external tools read them).
METRICS_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "consumed_samples")
STAGE_KEY = "stage"  # a run in stages: the stage's name on every step's line (its number: `stage_index`)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite fields of a metrics record under their TensorBoard names (`train/<key>`)."""
    return {f"train/{k}": v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}


class MetricsWriter:
    """Appends metrics lines and TensorBoard scalars. Create it only on the rank that has the loss.

    `sinks`: more receivers of the TensorBoard scalars, each with `log(step, scalars)` and `close()`.
    """

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, sinks: list | tuple = ()):
        self.sinks = list(sinks)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self._stage = None  # the stage named last in TensorBoard's text
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
            except Exception as exc:  # tensorboard missing or broken: metrics.jsonl still written
                print(f"[metrics] TensorBoard disabled: {exc}", flush=True)

    def truncate_after(self, step: int) -> None:
        """Drop lines for steps > `step` (written after the checkpoint a resumed run restarts from)."""
        self._file.close()
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line from a killed run
        write_atomic(self.path, "".join(k + "\n" for k in kept))
        self._file = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        ordered = {k: record[k] for k in METRICS_KEYS if k in record}
        ordered.update({k: v for k, v in record.items() if k not in ordered})
        self._file.write(json.dumps(ordered) + "\n")
        values = scalars(ordered)
        stage = record.get(STAGE_KEY)
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, record["step"])
            if stage is not None and stage != self._stage:  # the name where it starts (the number on every step)
                self._tb.add_text(f"train/{STAGE_KEY}", stage, record["step"])
        self._stage = stage
        for sink in self.sinks:
            sink.log(record["step"], values if stage is None else {**values, f"train/{STAGE_KEY}": stage})

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self.sinks:
            sink.close()


def format_step_line(record: dict[str, Any], total_steps: int) -> str:
    """A readable one-line summary of a step for the rank-0 log."""
    parts = [
        f"step {record['step']:>6}/{total_steps}",
        f"loss {record['loss']:.6f}",
        f"lr {record['lr']:.3e}",
        f"grad_norm {record['grad_norm']:.4f}",
        f"{record['tokens_per_s']:,.0f} tok/s",
        f"{record['step_time_s'] * 1000:.0f} ms",
    ]
    if "mfu" in record:
        parts.append(f"MFU {record['mfu'] * 100:.1f}%")
    if "mem_gib" in record:
        parts.append(f"mem {record['mem_gib']:.1f} GiB")
    if STAGE_KEY in record:
        parts.append(f"stage {record[STAGE_KEY]}")
    return " | ".join(parts)
