"""Loading a checkpoint: what each rank will read is checked first (names, shapes, safe objects), on every rank."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from pretrain.checkpoint import fsdp_format, optimizer_forms
from pretrain.checkpoint.dropped import check_dropped, model_config_diff
from pretrain.checkpoint.format import (
    CheckpointError,
    agree,
    checkpoint_backend,
    inspect_checkpoint,
    read_common,
    read_object_bytes,
    reason,
)
from pretrain.checkpoint.state import VOCAB_PADDED_KEYS
from pretrain.checkpoint.stateful import Io, run_level
from pretrain.compat import mcore


def _optimizer_config_diff(cfg, common: dict) -> str:
    saved = (common.get("config") or {}).get("optimizer") or {}
    ours = cfg.to_dict()["optimizer"]
    diffs = [f"optimizer.{k} {saved[k]} → {ours[k]}" for k in ("distributed", "fsdp")
             if k in saved and saved[k] != ours[k]]
    return f" (the checkpoint was written with {', '.join(diffs)})" if diffs else ""


def _check_requested(ctx, op: Io, index, state: dict) -> None:
    """What this rank will load (`state`) exists in the checkpoint `op.path` with the right shape and safe
    contents (vocabulary rows: at least the run's true vocabulary, from its plan)."""
    cfg, path, common, vocab = ctx.cfg, op.path, op.common, ctx.plan.layout.vocab_size
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
                                      f"{model_config_diff(cfg, common)}")
            if not isinstance(found, TensorStorageMetadata):
                raise CheckpointError(f"{path}: '{item.key}' is a pickled object in the checkpoint, "
                                      "expected a tensor")
            if item.allow_shape_mismatch and item.key.endswith(VOCAB_PADDED_KEYS):
                if tuple(found.size[1:]) != tuple(item.global_shape[1:]) or found.size[0] < vocab:
                    raise CheckpointError(
                        f"{path}: {what} '{item.key}' has shape {list(found.size)} in the checkpoint but "
                        f"{list(item.global_shape)} in this model (rows may differ by TP vocabulary padding, down to "
                        f"{vocab}; other dimensions must match){model_config_diff(cfg, common)}")
            elif tuple(found.size) != tuple(item.global_shape) and not item.allow_shape_mismatch:
                raise CheckpointError(
                    f"{path}: {what} '{item.key}' has shape {list(found.size)} in the checkpoint but "
                    f"{list(item.global_shape)} in this model{model_config_diff(cfg, common)}")
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

    Which pieces load and how is each piece's rule (`ctx.states`, `stateful.py`). Returns (step,
    consumed_samples); (0, 0) for a weights-only load. Raises CheckpointError naming the file and the mismatch
    for missing, truncated, foreign, unsafe or incompatible checkpoints.
    """
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    error, state, fills, pieces = None, {}, [], []
    op = Io(is_loading=True, weights_only=weights_only, path=path)
    try:
        backend = checkpoint_backend(path)
    except CheckpointError:
        backend = None  # inspect_checkpoint below reports why, on every rank
    if fsdp_format.is_fsdp(ctx.model) or backend == fsdp_format.FORMAT:
        return _load_fsdp_or_across(ctx, path, weights_only=weights_only)
    try:
        op.common, index = inspect_checkpoint(path)
        pieces = [piece for piece in ctx.states if piece.included(ctx, op)]
        for piece in pieces:
            state.update(piece.sharded_state_dict(ctx, state, op))
        fills = optimizer_forms.map_keys(state, index)
        _check_requested(ctx, op, index, state)
    except CheckpointError as exc:
        error = exc
    agree(error)
    check_dropped(ctx, path, op.common, index, weights_only=weights_only)  # same verdict on every rank

    try:
        loaded = mcore.load_sharded(state, str(path), get_default_load_sharded_strategy(str(path)), read_common)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        raise CheckpointError(f"{path}: loading failed ({reason(exc)})") from exc
    optimizer_forms.fill_from_model(loaded, fills)
    bad = _non_finite({k: v for k, v in loaded.items() if k.startswith(("model", "optimizer"))})
    agree(CheckpointError(f"{path}: corrupt checkpoint, {bad}") if bad else None)
    for piece in pieces:  # model, optimizer, RNG, then this config's schedule at the checkpoint's step
        piece.load_state_dict(ctx, loaded, op)
    if weights_only:
        return 0, 0
    return int(loaded["iteration"]), int(loaded["consumed_samples"])



def _load_fsdp_or_across(ctx, path: Path, *, weights_only: bool) -> tuple[int, int]:
    """An fsdp_dtensor checkpoint into a Megatron-FSDP run; anything across formats: `cross_format.py`."""
    error, common, index = None, {}, None
    try:
        common, index = inspect_checkpoint(path)
    except CheckpointError as exc:
        error = exc
    agree(error)
    check_dropped(ctx, path, common, index, weights_only=weights_only)
    fsdp_model = fsdp_format.is_fsdp(ctx.model)
    op = Io(is_loading=True, weights_only=weights_only, path=path, common=common)
    pieces = run_level(ctx, op)  # the schedule (this config's) and the record; the tensors: the format's own
    for piece in pieces:
        piece.sharded_state_dict(ctx, {}, op)
    if fsdp_model and checkpoint_backend(path) == fsdp_format.FORMAT:
        step, consumed = fsdp_format.load(ctx, path, common, index, weights_only=weights_only)
    else:
        from pretrain.checkpoint import cross_format

        step, consumed = cross_format.load_across(ctx, path, common, index, weights_only=weights_only)
    for piece in pieces:
        piece.load_state_dict(ctx, {}, op)
    return step, consumed
