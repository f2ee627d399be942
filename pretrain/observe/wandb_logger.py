"""Weights & Biases: the scalars TensorBoard gets, under the same names, in one W&B run per run directory.

    logging:
      wandb: {project: my-project, entity: my-team, name: llama-8b-run1, mode: online}  # or offline

The run id is kept in `run.dir/wandb_run_id`, so a requeued Slurm job (same run.dir) continues the same W&B run
(`resume="allow"`). Offline runs write `run.dir/wandb/offline-run-*/run-<id>.wandb`; `wandb sync` uploads them
into that one run. wandb is imported only when `logging.wandb.project` is set (`pip install -e '.[wandb]'`).
"""

from __future__ import annotations

import secrets
import string
from pathlib import Path

from pretrain.files import write_atomic

RUN_ID_FILE = "wandb_run_id"


def run_id(run_dir: Path) -> str:
    """The W&B run id of this run directory: read it, or create and keep one (atomically)."""
    path = run_dir / RUN_ID_FILE
    if path.exists():
        kept = path.read_text().strip()
        if kept:
            return kept
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's id style
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, new + "\n")
    return new


class WandbSink:
    """One W&B run receiving `log(step, scalars)`; steps the resumed W&B run already holds are skipped."""

    def __init__(self, cfg) -> None:
        import wandb

        w, run_dir = cfg.logging.wandb, Path(cfg.run.dir)
        self.run = wandb.init(project=w.project, entity=w.entity, name=w.name or cfg.run.name or run_dir.name,
                              mode=w.mode, dir=str(run_dir), id=run_id(run_dir), resume="allow",
                              config=cfg.to_dict(), settings=wandb.Settings(console="off", silent=True))
        # An online run resumed after a requeue already holds the steps logged before it; with exact resume
        # they are the same values, and W&B refuses steps below its current one.
        self.first_new_step = int(self.run.step or 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step >= self.first_new_step:
            self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_sinks(cfg) -> list[WandbSink]:
    """[WandbSink] when logging.wandb.project is set (and mode is not disabled), else []. Never raises: a W&B
    failure (no network for an online run, ...) is reported and training goes on with metrics.jsonl/TensorBoard."""
    w = cfg.logging.wandb
    if w.project is None or w.mode == "disabled":
        return []
    try:
        return [WandbSink(cfg)]
    except Exception as exc:  # noqa: BLE001 - any W&B failure must not stop (or hang) a multi-rank run
        print(f"[metrics] Weights & Biases disabled: {type(exc).__name__}: {exc}", flush=True)
        return []
