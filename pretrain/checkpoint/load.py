"""Loading a checkpoint: the backend of its format picked once (`backends.for_checkpoint`), which checks on every
rank what each rank will read (names, shapes, safe objects) before it reads."""

from __future__ import annotations

from pathlib import Path

from pretrain.checkpoint import backends
from pretrain.checkpoint.stateful import Io


def load_checkpoint(ctx, path: Path, *, weights_only: bool = False) -> tuple[int, int]:
    """Load model (and unless `weights_only`, optimizer, schedule, RNG) from `path` (all ranks call this).

    Which pieces load and how is each piece's rule (`ctx.states`, `stateful.py`); how the files are read, the
    format's (`backends.py`). Returns (step, consumed_samples); (0, 0) for a weights-only load, after which an
    optimizer's main parameters are taken from the loaded weights. Raises CheckpointError naming the file and the
    mismatch for missing, truncated, foreign, unsafe or incompatible checkpoints.
    """
    op = Io(is_loading=True, weights_only=weights_only, path=Path(path))
    backend = backends.for_checkpoint(ctx.model, op.path)
    step, consumed = backend.load(ctx, op)
    if weights_only and ctx.optimizer is not None:
        backend.reload_main_params(ctx)
    return step, consumed
