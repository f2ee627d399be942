"""Megatron-Core distributed checkpoints (`torch_dist`) under `run.dir/checkpoints/`.

Layout (Megatron's convention): `iter_0000010/` per checkpoint and `latest_checkpointed_iteration.txt`
naming the newest complete one. The pointer is written (atomically, by rank 0) only after every rank
finished writing, so a crash mid-save leaves the previous checkpoint selected. The model and
optimizer are saved as sharded tensors keyed by global names, so a checkpoint loads at any layout.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

TRACKER = "latest_checkpointed_iteration.txt"
OPTIMIZER_SHARDING = "fully_reshardable"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the file and the reason."""


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or os.path.join(cfg.run.dir, "checkpoints"))


def iteration_dir(root: Path, step: int) -> Path:
    return root / f"iter_{step:07d}"


def latest_iteration(root: Path) -> int | None:
    """The step named by the tracker file, or None when there is no complete checkpoint."""
    tracker = root / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text[:40]!r}") from None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _model_state(model) -> dict:
    """Sharded state of the (DDP-unwrapped) chunks: storage keys are the model's global names."""
    if len(model) == 1:
        return {"model": _unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def _rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def _layout_key(cfg) -> tuple:
    p = cfg.parallel
    return (dist.get_world_size(), p.tensor, p.pipeline, p.virtual_pipeline or 1, p.context)


def _sharded_state(cfg, model, optimizer, scheduler, *, step: int, consumed_samples: int,
                   with_optimizer: bool, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = _model_state(model)
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            {k: v for d in state.values() for k, v in d.items()},
            is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": OPTIMIZER_SHARDING},
        )
        state["opt_param_scheduler"] = scheduler.state_dict()
    world, rank = dist.get_world_size(), dist.get_rank()
    state["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    state["iteration"] = step
    state["consumed_samples"] = consumed_samples
    state["layout"] = list(_layout_key(cfg))
    state["config"] = cfg.to_dict()
    return state


def save_checkpoint(cfg, model, optimizer, scheduler, *, step: int, consumed_samples: int) -> Path:
    """Save a complete checkpoint for `step` and point the tracker at it (all ranks call this)."""
    from megatron.core import dist_checkpointing

    root = checkpoint_root(cfg)
    path = iteration_dir(root, step)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a partial save from a crashed run, never pointed to
            shutil.rmtree(path)
        path.mkdir()
    dist.barrier()
    state = _sharded_state(cfg, model, optimizer, scheduler, step=step, consumed_samples=consumed_samples,
                           with_optimizer=cfg.checkpoint.save_optimizer, is_loading=False)
    dist_checkpointing.save(state, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (path / "run_config.yaml").write_text(cfg.to_yaml())
        _write_atomic(root / TRACKER, f"{step}\n")
        _prune(root, cfg.checkpoint.keep_last, keep=step)
    dist.barrier()
    return path


def _prune(root: Path, keep_last: int | None, keep: int) -> None:
    if not keep_last:
        return
    iters = sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit())
    for it in iters[:-keep_last]:
        if it != keep:
            shutil.rmtree(iteration_dir(root, it), ignore_errors=True)


def load_checkpoint(cfg, model, optimizer, scheduler, path: Path, *, weights_only: bool = False) -> tuple[int, int]:
    """Load model (and unless `weights_only`, optimizer, schedule, RNG) from `path`.

    Returns (step, consumed_samples); (0, 0) for a weights-only load.
    """
    from megatron.core import dist_checkpointing

    if not path.is_dir() or not (path / "metadata.json").exists():
        raise CheckpointError(f"{path}: not a Megatron distributed checkpoint (no metadata.json)")
    common = dist_checkpointing.load_common_state_dict(str(path))
    with_optimizer = not weights_only and cfg.checkpoint.load_optimizer and "optimizer" in common
    same_layout = list(common.get("layout", [])) == list(_layout_key(cfg))
    state = _sharded_state(cfg, model, optimizer, scheduler, step=0, consumed_samples=0,
                           with_optimizer=with_optimizer, is_loading=True)
    if weights_only or not same_layout:
        state.pop("rng_state")
    if not with_optimizer:
        state.pop("optimizer", None)
        state.pop("opt_param_scheduler", None)
    loaded = dist_checkpointing.load(state, str(path))
    for key in [k for k in loaded if k.startswith("model")]:
        index = 0 if key == "model" else int(key[5:])
        _unwrap(model[index]).load_state_dict(loaded[key], strict=True)
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if "rng_state" in loaded:
        rng = loaded["rng_state"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    if weights_only:
        return 0, 0
    return int(loaded["iteration"]), int(loaded["consumed_samples"])


def resolve_checkpoint(path: str | Path, iteration: int | None = None) -> Path:
    """An iteration directory from a run dir, a checkpoints dir or an iteration dir itself."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint or run directory")
    if (p / "metadata.json").exists():
        return p
    for root in (p, p / "checkpoints"):
        if iteration is not None and iteration_dir(root, iteration).exists():
            return iteration_dir(root, iteration)
        latest = latest_iteration(root) if iteration is None else None
        if latest is not None:
            return iteration_dir(root, latest)
    what = f"iteration {iteration}" if iteration is not None else f"complete checkpoint ({TRACKER})"
    raise CheckpointError(f"{p}: no {what} found")


resolve_pretrained = resolve_checkpoint


def read_saved_config(path: Path) -> dict:
    """The config a checkpoint was written with (from run_config.yaml)."""
    cfg_file = path / "run_config.yaml"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no run_config.yaml beside the checkpoint")
    return yaml.safe_load(cfg_file.read_text())
