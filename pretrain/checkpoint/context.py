"""What save, load and resume act on, handed over as one object instead of loose argument lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _default_states() -> list:
    from pretrain.checkpoint.stateful import default_states

    return default_states()


@dataclass
class CheckpointContext:
    """The run's model chunks, optimizer and LR schedule (None for a weights-only load), its `RunPlan` (the
    layout and tokenizer a checkpoint records and a resume compares) and the checkpoint's pieces (`states`:
    `stateful.Stateful` objects, each with its save and load rule; save and load of torch_dist iterate them)."""

    model: list
    optimizer: Any
    scheduler: Any
    plan: Any  # pretrain.run_plan.RunPlan
    states: list = field(default_factory=_default_states)

    @property
    def cfg(self):
        return self.plan.cfg

    def parts(self) -> tuple:
        """(cfg, model, optimizer, scheduler), for the functions that use all four."""
        return self.plan.cfg, self.model, self.optimizer, self.scheduler
