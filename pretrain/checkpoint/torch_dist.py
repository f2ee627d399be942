"""Megatron-Core's `torch_dist` checkpoint format (runs with Megatron DDP, with or without the distributed
optimizer): one of the backends `load.py` / `save.py` pick (`backends.py`).

The state is the pieces' (`stateful.py`: model, optimizer, RNG as sharded tensors and objects under global names,
the run-level entries as common state), written and read by `dist_checkpointing` (`compat.mcore.save_sharded` /
`load_sharded`). Before anything is read every rank checks what it will load against the checkpoint's index
(`check_requested`: names, shapes, objects through the weights-only loader), and after the read that no model or
optimizer tensor holds NaN/Inf.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import torch

from pretrain.checkpoint import optimizer_forms
from pretrain.checkpoint.dropped import check_dropped, model_config_diff
from pretrain.checkpoint.format import (
    COMMON_FILE,
    RUN_CONFIG_FILE,
    CheckpointError,
    agree,
    inspect_checkpoint,
    read_common,
    read_object_bytes,
    reason,
    write_format_file,
)
from pretrain.checkpoint.state import VOCAB_PADDED_KEYS, model_state
from pretrain.checkpoint.stateful import Io, sharded_state
from pretrain.compat import mcore
from pretrain.files import write_atomic

FORMAT = "torch_dist"


def write_checkpoint_files(path: Path, common: dict, run_config_yaml: str) -> None:
    """The non-tensor files of a torch_dist checkpoint written outside Megatron-Core (the HF import):
    `metadata.json`, `common.pt` and, last, `run_config.yaml`."""
    write_format_file(path, FORMAT)
    torch.save(common, path / COMMON_FILE)
    write_atomic(path / RUN_CONFIG_FILE, run_config_yaml)


def _save_strategy(async_save: bool):
    """torch_dist, with the writes of replicated tensors spread over the data-parallel ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy(FORMAT)
    if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, ps.get_data_parallel_group(with_context_parallel=True), do_cache_distribution=False)
    return strategy


def _optimizer_config_diff(o, common: dict) -> str:
    """' (the checkpoint was written with optimizer.distributed A → B, ...)' or '' (`o`: this run's optimizer
    section)."""
    saved = (common.get("config") or {}).get("optimizer") or {}
    ours = dataclasses.asdict(o)
    diffs = [f"optimizer.{k} {saved[k]} → {ours[k]}" for k in ("distributed", "fsdp")
             if k in saved and saved[k] != ours[k]]
    return f" (the checkpoint was written with {', '.join(diffs)})" if diffs else ""


def _check_tensor(ctx, op: Io, index, item) -> None:
    """One ShardedTensor this rank will load: in the checkpoint, a tensor, of the same global shape (vocabulary
    rows: TP padding may differ, down to the run's true vocabulary). The messages name what differs from the
    checkpoint's config (model section; optimizer.distributed / fsdp for optimizer state)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path, common, vocab = op.path, op.common, ctx.plan.layout.vocab_size
    m = ctx.plan.cfg.model
    found = index.state_dict_metadata.get(item.key)
    what = "optimizer state" if "optimizer." in item.key else "tensor"
    if found is None:
        why = _optimizer_config_diff(ctx.plan.cfg.optimizer, common) if what == "optimizer state" else ""
        raise CheckpointError(f"{path}: {what} '{item.key}' is not in the checkpoint{why}"
                              f"{model_config_diff(m, common)}")
    if not isinstance(found, TensorStorageMetadata):
        raise CheckpointError(f"{path}: '{item.key}' is a pickled object in the checkpoint, "
                              "expected a tensor")
    if item.allow_shape_mismatch and item.key.endswith(VOCAB_PADDED_KEYS):
        if tuple(found.size[1:]) != tuple(item.global_shape[1:]) or found.size[0] < vocab:
            raise CheckpointError(
                f"{path}: {what} '{item.key}' has shape {list(found.size)} in the checkpoint but "
                f"{list(item.global_shape)} in this model (rows may differ by TP vocabulary padding, down to "
                f"{vocab}; other dimensions must match){model_config_diff(m, common)}")
    elif tuple(found.size) != tuple(item.global_shape) and not item.allow_shape_mismatch:
        raise CheckpointError(
            f"{path}: {what} '{item.key}' has shape {list(found.size)} in the checkpoint but "
            f"{list(item.global_shape)} in this model{model_config_diff(m, common)}")


def _check_object(path: Path, index, item) -> None:
    """One ShardedObject this rank will load: in the checkpoint, an object, and safe for the weights-only loader."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    found = index.state_dict_metadata.get(item.unique_key)
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


def non_finite(tree, name: str = "") -> str | None:
    """'tensor NAME holds N NaN/Inf values' for the first floating-point tensor in `tree` that has any."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and tree.numel():
            bad = tree.numel() - int(torch.isfinite(tree).sum())
            if bad:
                return f"tensor '{name}' holds {bad} NaN/Inf values (of {tree.numel()} on this rank)"
        return None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        found = non_finite(value, f"{name}.{key}" if name else str(key))
        if found:
            return found
    return None


class TorchDist:
    """The torch_dist backend (`backends.Backend`)."""

    name = FORMAT

    def save(self, ctx, path: Path, op: Io, *, async_save: bool):
        """Write the pieces' state of `op` to `path`: now (returns None), or as Megatron-Core's AsyncRequest that writes
        it in the background (`async_save`)."""
        state = sharded_state(ctx, op)
        request = mcore.save_sharded(state, str(path), _save_strategy(async_save), async_save=async_save)
        return request if async_save else None

    def load(self, ctx, op: Io) -> tuple[int, int]:
        """Load the torch_dist checkpoint `op.path`: every piece of `ctx.states` that takes part (`op`), checked
        first on every rank. Returns (step, consumed_samples); (0, 0) for a weights-only load."""
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
        from torch.distributed.checkpoint.api import CheckpointException

        path = op.path
        error, state, fills, pieces, index = None, {}, [], [], None
        try:
            op.common, index = inspect_checkpoint(path)
            pieces = [piece for piece in ctx.states if piece.included(ctx, op)]
            for piece in pieces:
                state.update(piece.sharded_state_dict(ctx, state, op))
            fills = optimizer_forms.map_keys(state, index)
            self.check_requested(ctx, op, index, state)
        except CheckpointError as exc:
            error = exc
        agree(error)
        check_dropped(ctx, op, index, self.model_names)  # same verdict on every rank

        try:
            loaded = mcore.load_sharded(state, str(path), get_default_load_sharded_strategy(str(path)), read_common)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
            raise CheckpointError(f"{path}: loading failed ({reason(exc)})") from exc
        optimizer_forms.fill_from_model(loaded, fills)
        bad = non_finite({k: v for k, v in loaded.items() if k.startswith(("model", "optimizer"))})
        agree(CheckpointError(f"{path}: corrupt checkpoint, {bad}") if bad else None)
        for piece in pieces:  # model, optimizer, RNG, then this config's schedule at the checkpoint's step
            piece.load_state_dict(ctx, loaded, op)
        if op.weights_only:
            return 0, 0
        return int(loaded["iteration"]), int(loaded["consumed_samples"])

    def check_requested(self, ctx, op: Io, index, state: dict) -> None:
        """What this rank will load (`state`) exists in the checkpoint `op.path` with the right shape and safe
        contents (vocabulary rows: at least the run's true vocabulary, from its plan)."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        for item in nested_values(state):
            if isinstance(item, ShardedTensor):
                _check_tensor(ctx, op, index, item)
            elif isinstance(item, ShardedObject):
                _check_object(op.path, index, item)

    def model_names(self, model) -> set[str]:
        """The model tensors this rank's (DDP-wrapped) chunks take, by torch_dist name."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

        # A factory is stored under the keys of the tensors it builds, which may differ from its own: Mamba's and
        # Gated DeltaNet's fused in_proj / conv1d are stored as one tensor per part (`...in_proj.weight.z`, `.x`,
        # `.B`, `.C`, `.dt`; `.query`, `.key`, ...).
        state = model_state(model, is_loading=True)
        apply_factories(state)  # views of the parameters, as the load itself builds them
        return {item.key for item in nested_values(state) if isinstance(item, ShardedTensor)}

    def reload_main_params(self, ctx) -> None:
        """After a weights-only load: DDP's and the distributed optimizer's main params are copies of the model
        params made at construction, taken again from the loaded weights."""
        ctx.optimizer.reload_model_params()
