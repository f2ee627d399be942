"""What save, load and resume act on, handed over as one object instead of loose argument lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _default_states() -> list:
    from pretrain.checkpoint.stateful import default_states

    return default_states()


@dataclass
class CheckpointContext:
    """The run's model chunks, optimizer and LR schedule (None for a weights-only load), its `RunPlan` (the
    layout and tokenizer a checkpoint records and a resume compares) and the checkpoint's pieces (`states`:
    `stateful.Stateful` objects, each with its save and load rule; save and load of torch_dist iterate them).

    The checkpoint code reads the config through the few views below (the checkpoint section, where checkpoints
    go, the run dir, the whole tree a checkpoint records), not the config tree itself."""

    model: list
    optimizer: Any
    scheduler: Any
    plan: Any  # pretrain.run_plan.RunPlan
    states: list = field(default_factory=_default_states)
    # What the checkpoint resumed from recorded of `state.RUN_STATE` (read once by the load, each entry for its
    # owner: the result checks' window, the stage); empty without a resume.
    run_state: dict = field(default_factory=dict)

    @property
    def settings(self):
        """The checkpoint section (`pretrain.config.CheckpointConfig`)."""
        return self.plan.cfg.checkpoint

    @property
    def run_dir(self) -> Path:
        return Path(self.plan.cfg.run.dir)

    @property
    def root(self) -> Path:
        """Where this run's checkpoints go (`pretrain.run.run_dir.checkpoint_root`)."""
        from pretrain.run.run_dir import checkpoint_root

        return checkpoint_root(self.plan.cfg)

    def run_config(self) -> dict:
        """The whole config tree, as a checkpoint records it (common state, `run_config.yaml`)."""
        return self.plan.cfg.to_dict()

    def run_config_yaml(self) -> str:
        return self.plan.cfg.to_yaml()
