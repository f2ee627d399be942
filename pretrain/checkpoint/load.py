"""Loading a checkpoint: what each rank will read is checked first (names, shapes, safe objects), on every rank."""

from __future__ import annotations

import io
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.checkpoint import contract, fsdp_format, optimizer_forms
from pretrain.checkpoint.format import (
    CheckpointError,
    agree,
    checkpoint_backend,
    inspect_checkpoint,
    read_common,
    read_object_bytes,
    reason,
)
from pretrain.checkpoint.state import VOCAB_PADDED_KEYS, set_rng_state, sharded_state, unwrap
from pretrain.compat import mcore


def _model_config_diff(cfg, common: dict) -> str:
    saved = (common.get("config") or {}).get("model") or {}
    ours = cfg.to_dict()["model"]
    diffs = [f"{k} {saved[k]!r} → {ours[k]!r}" for k in ours if k in saved and saved[k] != ours[k]]
    return f"; model config differs from the checkpoint's: {', '.join(diffs)}" if diffs else ""


def _optimizer_config_diff(cfg, common: dict) -> str:
    saved = (common.get("config") or {}).get("optimizer") or {}
    ours = cfg.to_dict()["optimizer"]
    diffs = [f"optimizer.{k} {saved[k]} → {ours[k]}" for k in ("distributed", "fsdp")
             if k in saved and saved[k] != ours[k]]
    return f" (the checkpoint was written with {', '.join(diffs)})" if diffs else ""


def _check_requested(cfg, path: Path, index, common: dict, state: dict, vocab: int) -> None:
    """What this rank will load exists in the checkpoint with the right shape and safe contents (`vocab`: the run's
    true vocabulary, from its plan)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    meta = index.state_dict_metadata
    for item in nested_values(state):
        if isinstance(item, ShardedTensor):
            found = meta.get(item.key)
            what = "optimizer state" if "optimizer." in item.key else "tensor"
            if found is None:
                why = _optimizer_config_diff(cfg, common) if what == "optimizer state" else ""
                raise CheckpointError(f"{path}: {what} '{item.key}' is not in the checkpoint{why}"
                                      f"{_model_config_diff(cfg, common)}")
            if not isinstance(found, TensorStorageMetadata):
                raise CheckpointError(f"{path}: '{item.key}' is a pickled object in the checkpoint, "
                                      "expected a tensor")
            if item.allow_shape_mismatch and item.key.endswith(VOCAB_PADDED_KEYS):
                if tuple(found.size[1:]) != tuple(item.global_shape[1:]) or found.size[0] < vocab:
                    raise CheckpointError(
                        f"{path}: {what} '{item.key}' has shape {list(found.size)} in the checkpoint but "
                        f"{list(item.global_shape)} in this model (rows may differ by TP vocabulary padding, down to "
                        f"{vocab}; other dimensions must match){_model_config_diff(cfg, common)}")
            elif tuple(found.size) != tuple(item.global_shape) and not item.allow_shape_mismatch:
                raise CheckpointError(
                    f"{path}: {what} '{item.key}' has shape {list(found.size)} in the checkpoint but "
                    f"{list(item.global_shape)} in this model{_model_config_diff(cfg, common)}")
        elif isinstance(item, ShardedObject):
            found = meta.get(item.unique_key)
            if found is None:
                raise CheckpointError(f"{path}: object '{item.unique_key}' is not in the checkpoint")
            if not isinstance(found, BytesStorageMetadata):
                raise CheckpointError(f"{path}: '{item.unique_key}' is a tensor in the checkpoint, expected an object")
            data = read_object_bytes(path, index, item.unique_key)
            if data is not None:
                try:
                    torch.load(io.BytesIO(data), weights_only=True)
                except Exception as exc:
                    raise CheckpointError(f"{path}: object '{item.unique_key}' refused by the weights-only "
                                          f"loader, untrusted pickles are never loaded ({reason(exc)})") from None



def _non_finite(tree, name: str = "") -> str | None:
    """'tensor NAME holds N NaN/Inf values' for the first floating-point tensor in `tree` that has any."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and tree.numel():
            bad = tree.numel() - int(torch.isfinite(tree).sum())
            if bad:
                return f"tensor '{name}' holds {bad} NaN/Inf values (of {tree.numel()} on this rank)"
        return None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        found = _non_finite(value, f"{name}.{key}" if name else str(key))
        if found:
            return found
    return None


def load_checkpoint(ctx, path: Path, *, weights_only: bool = False) -> tuple[int, int]:
    """Load model (and unless `weights_only`, optimizer, schedule, RNG) from `path` (all ranks call this).

    Returns (step, consumed_samples); (0, 0) for a weights-only load. Raises CheckpointError naming the
    file and the mismatch for missing, truncated, foreign, unsafe or incompatible checkpoints.
    """
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from torch.distributed.checkpoint.api import CheckpointException

    cfg, model, optimizer, scheduler = ctx.parts()
    path = Path(path)
    error, common, state, fills = None, {}, {}, []
    try:
        backend = checkpoint_backend(path)
    except CheckpointError:
        backend = None  # inspect_checkpoint below reports why, on every rank
    if fsdp_format.is_fsdp(model) or backend == fsdp_format.FORMAT:
        return _load_fsdp_or_across(ctx, path, weights_only=weights_only)
    try:
        common, index = inspect_checkpoint(path)
        with_optimizer = not weights_only and cfg.checkpoint.load_optimizer and "optimizer" in common
        same_layout = list(common.get("layout", [])) == list(ctx.plan.layout_key())
        state = sharded_state(ctx, step=0, consumed_samples=0, with_optimizer=with_optimizer, is_loading=True)
        if weights_only or not same_layout:
            state.pop("rng_state")
        if not with_optimizer:
            state.pop("optimizer", None)
        state.pop("opt_param_scheduler", None)  # the schedule is this config's (contract.apply_new_schedule)
        fills = optimizer_forms.map_keys(state, index)
        _check_requested(cfg, path, index, common, state, ctx.plan.layout.vocab_size)
    except CheckpointError as exc:
        error = exc
    agree(error)

    try:
        loaded = mcore.load_sharded(state, str(path), get_default_load_sharded_strategy(str(path)), read_common)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        raise CheckpointError(f"{path}: loading failed ({reason(exc)})") from exc
    optimizer_forms.fill_from_model(loaded, fills)
    bad = _non_finite({k: v for k, v in loaded.items() if k.startswith(("model", "optimizer"))})
    agree(CheckpointError(f"{path}: corrupt checkpoint, {bad}") if bad else None)
    for key in [k for k in loaded if k.startswith("model")]:
        index_ = 0 if key == "model" else int(key[5:])
        try:
            unwrap(model[index_]).load_state_dict(loaded[key], strict=True)
        except RuntimeError as exc:
            raise CheckpointError(f"{path}: model weights do not fit this model ({reason(exc)})") from None
    fresh = None if weights_only else contract.hyperparameters(optimizer)  # this config's lr, betas, eps, wd
    if with_optimizer:
        optimizer.load_state_dict(optimizer_forms.convert_common(optimizer, loaded["optimizer"]))
    if not weights_only:  # the checkpoint's step count, this config's schedule
        num_steps = (common.get("opt_param_scheduler") or {}).get("num_steps", common.get("iteration", 0))
        contract.apply_new_schedule(optimizer, scheduler, fresh, int(num_steps))
    if "rng_state" in loaded:
        set_rng_state(loaded["rng_state"])
    written_by = common.get("megatron_core")
    if written_by and written_by != str(mcore.MCORE) and dist.get_rank() == 0:
        print(f"[pretrain] {path} was written by megatron-core {written_by}, continuing with {mcore.MCORE}",
              flush=True)
    if weights_only:
        return 0, 0
    return int(loaded["iteration"]), int(loaded["consumed_samples"])



def _load_fsdp_or_across(ctx, path: Path, *, weights_only: bool) -> tuple[int, int]:
    """An fsdp_dtensor checkpoint into a Megatron-FSDP run; anything across formats: `cross_format.py`."""
    model, optimizer, scheduler = ctx.model, ctx.optimizer, ctx.scheduler
    error, common, index = None, {}, None
    try:
        common, index = inspect_checkpoint(path)
    except CheckpointError as exc:
        error = exc
    agree(error)
    fsdp_model = fsdp_format.is_fsdp(model)
    fresh = None if weights_only else contract.hyperparameters(optimizer)  # this config's lr, betas, eps, wd
    if fsdp_model and checkpoint_backend(path) == fsdp_format.FORMAT:
        step, consumed = fsdp_format.load(ctx, path, common, index,
                                          weights_only=weights_only)
    else:
        from pretrain.checkpoint import cross_format

        step, consumed = cross_format.load_across(ctx, path, common, index,
                                                  weights_only=weights_only)
    if not weights_only:  # the checkpoint's step count, this config's schedule (as for torch_dist above)
        num_steps = (common.get("opt_param_scheduler") or {}).get("num_steps", common.get("iteration", 0))
        contract.apply_new_schedule(optimizer, scheduler, fresh, int(num_steps))
    written_by = common.get("megatron_core")
    if written_by and written_by != str(mcore.MCORE) and dist.get_rank() == 0:
        print(f"[pretrain] {path} was written by megatron-core {written_by}, continuing with {mcore.MCORE}",
              flush=True)
    return step, consumed
