"""What save, load and resume act on, handed over as one object instead of loose argument lists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CheckpointContext:
    """The run's model chunks, optimizer and LR schedule (None for a weights-only load) and its `RunPlan` (the
    layout and tokenizer a checkpoint records and a resume compares)."""

    model: list
    optimizer: Any
    scheduler: Any
    plan: Any  # pretrain.run_plan.RunPlan

    @property
    def cfg(self):
        return self.plan.cfg

    def parts(self) -> tuple:
        """(cfg, model, optimizer, scheduler), for the functions that use all four."""
        return self.plan.cfg, self.model, self.optimizer, self.scheduler
