"""The checkpoint formats behind one interface, and the choice of one: `save.py` and `load.py` pick a backend once
per save or load and call it; nothing else branches on the format.

- `torch_dist.TorchDist`: Megatron-Core's format, for runs with Megatron DDP (with or without the distributed
  optimizer);
- `fsdp_format.FsdpDtensor`: Megatron-FSDP's `fsdp_dtensor`, for runs with `optimizer.fsdp=true`;
- `cross_format.AcrossFormats`: a checkpoint of the other format than the run's, loaded into it (saves go to the
  run's own format).

A run saves in the format of its model chunks (Megatron-FSDP-wrapped or not); `format.py` holds what every format
shares (names, the tracker, the commit, the safe readers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from pretrain.checkpoint.format import CheckpointError, checkpoint_backend


class Backend(Protocol):
    """One checkpoint format (`ctx`: a `CheckpointContext`, `op`: a `stateful.Io`)."""

    name: str  # what metadata.json names: "torch_dist", "fsdp_dtensor"

    def save(self, ctx, path: Path, op, *, async_save: bool):
        """Write the run's state of `op` (step, consumed samples) into the new directory `path` (collective): now,
        returning None, or (`async_save`) as Megatron-Core's AsyncRequest that writes it in the background. The
        caller commits."""

    def load(self, ctx, op) -> tuple[int, int]:
        """Load the checkpoint `op.path` into `ctx` (collective; `op.weights_only`: the model weights only), each rank
        checking first what it will read: (step, consumed_samples), (0, 0) for weights only."""

    def check_requested(self, ctx, op, index, state: dict) -> None:
        """Raise CheckpointError when what this rank will load (`state`) is not in the checkpoint (`index`, its
        `.metadata`) as this run needs it: missing, another shape, an object where a tensor belongs, an unsafe
        pickle."""

    def model_names(self, model) -> set[str]:
        """The tensors this rank's model chunks take, by torch_dist name (`dropped.check_dropped` compares them
        with the checkpoint's)."""

    def reload_main_params(self, ctx) -> None:
        """After a weights-only load: the optimizer's main parameters taken from the loaded weights."""


def for_run(model) -> Backend:
    """The format this run saves in: fsdp_dtensor for Megatron-FSDP model chunks, else torch_dist."""
    from pretrain.checkpoint import fsdp_format

    if fsdp_format.is_fsdp(model):
        return fsdp_format.FsdpDtensor()
    from pretrain.checkpoint.torch_dist import TorchDist

    return TorchDist()


def for_checkpoint(model, path: Path) -> Backend:
    """The backend that loads the checkpoint `path` into `model`: the run's own, or `AcrossFormats` when the
    checkpoint is in the other format. An unreadable `metadata.json` picks the run's own, whose checks say why on
    every rank."""
    own = for_run(model)
    try:
        found = checkpoint_backend(path)
    except CheckpointError:
        found = None
    if found is None or found == own.name:
        return own
    from pretrain.checkpoint.cross_format import AcrossFormats

    return AcrossFormats(own)
