"""Megatron-Core distributed checkpoints (`torch_dist`) under `run.dir/checkpoints/`.

Layout (Megatron's convention): `iter_0000010/` per checkpoint and `latest_checkpointed_iteration.txt`
naming the newest complete one. The tracker is written atomically by rank 0 only after every rank finished
writing (for an asynchronous save: when the save is finalised), so a crash mid-save leaves the previous
checkpoint selected. Model and optimizer (the distributed optimizer in the `fully_reshardable` format) are
sharded tensors keyed by global names, so a checkpoint loads at any TP/PP/VP/DP layout. The LR schedule,
step, consumed samples, config and per-rank RNG states (Python, NumPy, torch, Megatron's RNG tracker) make
a same-layout resume exact.

Loading never unpickles untrusted data: `common.pt` and the checkpoint's byte objects go through torch's
weights-only loader, `.metadata` through an allow-list unpickler, and every file the index refers to is
checked to exist and be long enough before any rank starts loading.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import pickle
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from pretrain.compat import mcore

TRACKER = "latest_checkpointed_iteration.txt"
OPTIMIZER_SHARDING = "fully_reshardable"
COMMON_FILE = "common.pt"
INDEX_FILE = ".metadata"
COMMON_OBJECT = "common_state/shard_0_1"  # megatron-core 0.19+: common state inside the torch_dist files
FORMAT_FILE = "metadata.json"
RUN_CONFIG_FILE = "run_config.yaml"  # written by the commit: its presence marks a complete checkpoint


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the file and the reason."""


# --------------------------------------------------------------------------------------------------
# Paths and the tracker
# --------------------------------------------------------------------------------------------------


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or os.path.join(cfg.run.dir, "checkpoints"))


def iteration_dir(root: Path, step: int) -> Path:
    return root / f"iter_{step:07d}"


def latest_iteration(root: Path) -> int | None:
    """The step named by the tracker file, or None when there is no tracker."""
    tracker = root / TRACKER
    if not tracker.exists():
        return None
    try:
        text = tracker.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{tracker}: not a text file (expected an iteration number); restore it or "
                              "delete it to resume from the newest complete checkpoint") from None
    except OSError as exc:
        raise CheckpointError(f"{tracker}: unreadable ({exc.strerror})") from None
    try:
        step = int(text)
    except ValueError:
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text[:40]!r}") from None
    if not iteration_dir(root, step).is_dir():
        raise CheckpointError(f"{tracker}: names iteration {step} but {iteration_dir(root, step)} does not exist")
    return step


def iterations(root: Path) -> list[int]:
    """Steps of the `iter_*` directories under `root`, ascending."""
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit() and p.is_dir())


def is_committed(path: Path) -> bool:
    """True for a checkpoint the save committed: `run_config.yaml` is written (atomically) only after every
    rank finished writing, just before the tracker moves. Without it a directory is a partial save."""
    return (path / RUN_CONFIG_FILE).is_file()


def _names(root: Path, steps: list[int]) -> str:
    return ", ".join(iteration_dir(root, s).name for s in steps)


def resume_step(root: Path) -> tuple[int | None, str | None]:
    """(step to resume from or None, a note for the log); raises CheckpointError when it must refuse.

    The tracker selects the checkpoint. Without one, the newest committed checkpoint is used if it is
    intact. A committed checkpoint is never given up silently: newer committed ones than the tracker's,
    or a damaged newest one without a tracker, stop the run with what to do.
    """
    tracker = root / TRACKER
    steps = iterations(root)
    tracked = latest_iteration(root)
    committed = [s for s in steps if is_committed(iteration_dir(root, s))]
    if tracked is not None:
        newer = [s for s in committed if s > tracked]
        if newer:
            raise CheckpointError(
                f"{tracker}: names iteration {tracked} but newer complete checkpoints exist ({_names(root, newer)}); "
                f"to continue from the newest write {newer[-1]} into it, to go back to {tracked} move the newer "
                f"ones out of {root}")
        return tracked, None
    if not committed:
        partial = f"; partial saves {_names(root, steps)} will be replaced" if steps else ""
        return None, (f"no complete checkpoint in {root}, starting from step 0{partial}" if steps else None)
    newest = iteration_dir(root, committed[-1])
    try:
        inspect_checkpoint(newest)
    except CheckpointError as exc:
        older = f" (older complete: {_names(root, committed[:-1])})" if committed[:-1] else ""
        raise CheckpointError(
            f"{tracker} is missing and the newest complete checkpoint cannot be used{older}: {exc}; write the "
            f"iteration to resume from into {tracker}, after moving {newest.name} out of {root}") from None
    return committed[-1], (f"{tracker} is missing: resuming from the newest complete checkpoint {newest} "
                           f"(complete checkpoints found: {_names(root, committed)})")


def find_resume(cfg) -> tuple[Path | None, str | None]:
    """`resume_step` decided on rank 0 and shared (collective): (checkpoint dir or None, note to log)."""
    root = checkpoint_root(cfg)
    decision: list = [None]
    if dist.get_rank() == 0:
        try:
            decision[0] = ("ok", *resume_step(root))
        except CheckpointError as exc:
            decision[0] = ("error", str(exc), None)
    dist.broadcast_object_list(decision, src=0)
    kind, value, note = decision[0]
    if kind == "error":
        raise CheckpointError(value)
    return (iteration_dir(root, value) if value is not None else None), note


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# What a checkpoint holds
# --------------------------------------------------------------------------------------------------


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


# Vocabulary-sized tensors: their rows are padded to a multiple of make_vocab_size_divisible_by × TP, so a
# checkpoint written at another TP may hold more or fewer (all-zero) padding rows. Loading reads the rows both
# have; `_check_requested` still insists on the real vocabulary and equal other dimensions.
VOCAB_PADDED_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _model_state(model, is_loading: bool = False) -> dict:
    """Sharded state of the (DDP-unwrapped) chunks: storage keys are the model's global names."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if len(model) == 1:
        state = {"model": _unwrap(model[0]).sharded_state_dict()}
    else:
        state = {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}
    if is_loading:
        for item in nested_values(state):
            if isinstance(item, ShardedTensor) and item.key in VOCAB_PADDED_KEYS:
                item.allow_shape_mismatch = True
    return state


def _rng_state() -> dict:
    """This rank's RNG states as tensors and plain values (loadable by the weights-only unpickler)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }


def _set_rng_state(rng: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    n = rng["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if rng.get("tracker"):
        get_cuda_rng_tracker().set_states(rng["tracker"])


def _layout_key(cfg) -> tuple:
    """What must be equal for per-rank state (RNG) to be restored; MoE adds expert parallel and expert TP."""
    p = cfg.parallel
    key = (dist.get_world_size(), p.tensor, p.pipeline, p.virtual_pipeline or 1, p.context)
    if cfg.model.num_moe_experts:
        key += (p.expert, p.expert_tensor or p.tensor)
    return key


def _sharded_state(cfg, model, optimizer, scheduler, *, step: int, consumed_samples: int,
                   with_optimizer: bool, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = _model_state(model, is_loading=is_loading)
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state),
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
    state["megatron_core"] = str(mcore.MCORE)  # the release that wrote it (any supported release reads it)
    return state


# --------------------------------------------------------------------------------------------------
# Saving (synchronous or asynchronous) and the atomic commit
# --------------------------------------------------------------------------------------------------


def _save_strategy(async_save: bool):
    """torch_dist, with the writes of replicated tensors spread over the data-parallel ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy("torch_dist")
    if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, ps.get_data_parallel_group(with_context_parallel=True), do_cache_distribution=False)
    return strategy


HELPER_BLOCKED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_WRITER_MANAGER = None


def start_writer_helper() -> None:
    """Start Megatron's checkpoint-writer results Manager so that it ignores SIGTERM/SIGUSR1 (idempotent).

    The `torch_dist` writer reports through a multiprocessing Manager that megatron-core 0.16.1 spawns at the
    first save (`filesystem_async._get_write_results_queue`). Slurm signals every process of a step before a
    time limit or preemption; the freshly spawned interpreter dies of SIGUSR1/SIGTERM and every later save
    fails (EOFError). Here the same Manager is started with those signals blocked in its server process
    (its initializer runs before the server starts threads; it imports only `pretrain.child_processes`, which
    is standard library). The trainer keeps its own handlers: it saves and exits on them. The Manager and
    every writer this process forks die with it (`pretrain/child_processes.py`), also on `kill -9`.
    """
    global _WRITER_MANAGER
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from pretrain.child_processes import die_with_this_process, parent_death_signal

    die_with_this_process()  # the forked writers too: none outlives a killed trainer
    # Its error lines ("Local process 0 encountered an error: ...") repeat what the save's CheckpointError says.
    logging.getLogger(filesystem_async.__name__).setLevel(logging.CRITICAL)
    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=functools.partial(parent_death_signal, os.getpid(), HELPER_BLOCKED_SIGNALS))
    _WRITER_MANAGER = manager
    filesystem_async._results_queue = manager.Queue()


def _commit(cfg, root: Path, path: Path, step: int) -> None:
    """Mark `path` complete and point the tracker at it once every rank has finished writing it (collective)."""
    dist.barrier()
    error = None
    if dist.get_rank() == 0:
        target = path / RUN_CONFIG_FILE
        try:
            _write_atomic(target, cfg.to_yaml())
            target = root / TRACKER
            _write_atomic(target, f"{step}\n")
        except OSError as exc:
            error = CheckpointError(f"{target}: committing the checkpoint failed ({exc.strerror or exc}); "
                                    "the tracker was not moved")
        else:
            _prune(root, cfg.checkpoint.keep_last, current=step)
    _agree(error)


def _prune(root: Path, keep_last: int | None, current: int) -> None:
    """Delete checkpoints beyond the newest `keep_last` and partial saves newer than `current`.

    A committed checkpoint newer than `current` is kept: only uncommitted leftovers of a crashed save are stale.
    """
    iters = iterations(root)
    stale = [it for it in iters if it > current and not is_committed(iteration_dir(root, it))]
    kept = [it for it in iters if it <= current]
    old = kept[:-keep_last] if keep_last else []
    for it in stale + old:
        shutil.rmtree(iteration_dir(root, it), ignore_errors=True)


class AsyncSaves:
    """Megatron-Core's queue of asynchronous `torch_dist` saves, committed when every rank is done.

    At most one save is in flight: scheduling a new one first finalises the previous one.
    """

    def __init__(self) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue(persistent=False)
        self.pending: int | None = None
        self.pending_path: Path | None = None

    def schedule(self, request) -> None:
        self.queue.schedule_async_request(request)

    def finalize(self, blocking: bool = False) -> list[int]:
        """Commit the saves whose writes finished on every rank (collective; call on all ranks)."""
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            done = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as exc:  # the writer failed, e.g. no space left on device
            error = save_failed(self.pending_path, exc)
            _discard_partial(self.pending_path)
            self.pending = self.pending_path = None
            raise error from exc
        if done:
            self.pending = self.pending_path = None
        return done

    def abort(self) -> None:
        """Stop waiting on the writer (after an error): the checkpoint stays uncommitted."""
        self.queue.close(abort=True)
        self.pending = self.pending_path = None


def save_checkpoint(cfg, model, optimizer, scheduler, *, step: int, consumed_samples: int,
                    async_saves: AsyncSaves | None = None) -> Path:
    """Save a checkpoint for `step` (all ranks call this); the tracker moves once it is complete.

    With `async_saves` the tensors are written by a background process and the checkpoint is committed
    by a later `async_saves.finalize()`; otherwise it is committed before this returns.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    if async_saves is not None and async_saves.pending is not None:
        async_saves.finalize(blocking=True)
    start_writer_helper()
    root = checkpoint_root(cfg)
    path = iteration_dir(root, step)
    error = None
    if dist.get_rank() == 0:
        try:
            _prepare_dir(root, path)
        except CheckpointError as exc:
            error = exc
    _agree(error)
    state = _sharded_state(cfg, model, optimizer, scheduler, step=step, consumed_samples=consumed_samples,
                           with_optimizer=cfg.checkpoint.save_optimizer, is_loading=False)
    try:
        if async_saves is None:
            mcore.save_sharded(state, str(path), _save_strategy(False), async_save=False)
            _commit(cfg, root, path, step)
        else:
            request = mcore.save_sharded(state, str(path), _save_strategy(True), async_save=True)
            request.add_finalize_fn(lambda: _commit(cfg, root, path, step))
            async_saves.schedule(request)
            async_saves.pending, async_saves.pending_path = step, path
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # e.g. no space left: one line naming the directory
        error = save_failed(path, exc)
        _discard_partial(path)
        raise error from exc
    return path


def _prepare_dir(root: Path, path: Path) -> None:
    """Create `path` for a save, replacing a partial save left by a crashed run (never a complete one)."""
    if path.exists() and is_committed(path):
        raise CheckpointError(f"{path}: a complete checkpoint is already there; refusing to overwrite it")
    try:
        root.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a partial save from a crashed run, never pointed to
            shutil.rmtree(path)
        path.mkdir()
    except OSError as exc:
        raise CheckpointError(f"{exc.filename or path}: cannot create the checkpoint directory "
                              f"({exc.strerror or exc})") from None


def _discard_partial(path: Path | None) -> None:
    """Rank 0 removes the uncommitted directory of a failed save (every rank has stopped writing to it)."""
    if path is not None and dist.get_rank() == 0 and not is_committed(path):
        shutil.rmtree(path, ignore_errors=True)


def save_failed(path: Path | None, exc: BaseException) -> CheckpointError:
    """The one-line error for a save that failed while writing (e.g. the disk is full)."""
    from pretrain.run_dir import write_failure

    why = write_failure(exc, path) if path is not None else None
    return CheckpointError(f"{path}: saving the checkpoint failed: {why or _reason(exc)}; nothing was committed")


# --------------------------------------------------------------------------------------------------
# Checking a checkpoint before loading it (no untrusted unpickling)
# --------------------------------------------------------------------------------------------------

_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
}


class _RefusedGlobal(pickle.UnpicklingError):
    """A global outside the allow-list of a checkpoint index."""


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a torch_dist `.metadata` index, refusing every global outside the index's own classes."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _INDEX_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _RefusedGlobal(f"global '{module}.{name}' is not allowed in a checkpoint index")


def _reason(exc: BaseException) -> str:
    from pretrain.compat.megatron_fixes import informative_line

    return informative_line(exc)


def read_common(path: Path, index=None) -> dict:
    """The checkpoint's common (non-sharded) state through torch's weights-only loader.

    megatron-core ≤ 0.18 writes it to `common.pt`; 0.19+ stores it as the `common_state` object inside the
    torch_dist files. A pickle of arbitrary objects is refused in both.
    """
    f = path / COMMON_FILE
    if f.is_file():
        what, source = f, f
    else:
        if index is None and (path / INDEX_FILE).is_file():
            index = read_index(path)
        data = _read_object_bytes(path, index, COMMON_OBJECT) if index is not None else None
        if data is None:
            raise CheckpointError(f"{f}: missing (incomplete checkpoint)")
        what, source = f"{path}: object '{COMMON_OBJECT}'", io.BytesIO(data)
    try:
        common = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"{what}: refused by the weights-only loader, untrusted pickles are never loaded "
                              f"({_reason(exc)})") from None
    except Exception as exc:
        raise CheckpointError(f"{what}: unreadable, truncated or not a torch file ({_reason(exc)})") from None
    if not isinstance(source, Path) and isinstance(common, list) and len(common) == 1:
        common = common[0]  # a ShardedObject's data is stored wrapped in a one-element list
    if not isinstance(common, dict):
        raise CheckpointError(f"{what}: expected a dict of common state, found {type(common).__name__}")
    return common


def read_index(path: Path):
    """The torch_dist `.metadata` index, unpickled with an allow-list."""
    f = path / INDEX_FILE
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (incomplete checkpoint)")
    try:
        with open(f, "rb") as fh:
            return _IndexUnpickler(fh).load()
    except _RefusedGlobal as exc:
        raise CheckpointError(f"{f}: refused, not a torch_dist checkpoint index ({_reason(exc)})") from None
    except Exception as exc:
        raise CheckpointError(f"{f}: unreadable or truncated checkpoint index ({_reason(exc)})") from None


def _check_format(path: Path) -> None:
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    fmt = path / FORMAT_FILE
    if not fmt.is_file():
        legacy = " (a legacy Megatron-LM torch checkpoint; only torch_dist is supported)" if any(
            path.glob("mp_rank_*")) else ""
        raise CheckpointError(f"{path}: not a Megatron-Core distributed checkpoint, {FORMAT_FILE} missing{legacy}")
    try:
        info = json.loads(fmt.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{fmt}: not valid JSON ({exc})") from None
    backend = info.get("sharded_backend") if isinstance(info, dict) else None
    if backend != "torch_dist":
        raise CheckpointError(f"{fmt}: sharded_backend is {backend!r}, this trainer reads 'torch_dist'")


def _check_files(path: Path, index) -> None:
    """Every data file the index refers to exists and holds the bytes the index expects."""
    need: dict[str, int] = {}
    for info in index.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing, the checkpoint index refers to it")
        have = f.stat().st_size
        if have < size:
            raise CheckpointError(f"{f}: truncated, {have} bytes but the checkpoint index needs {size}")


def _model_config_diff(cfg, common: dict) -> str:
    saved = (common.get("config") or {}).get("model") or {}
    ours = cfg.to_dict()["model"]
    diffs = [f"{k} {saved[k]!r} → {ours[k]!r}" for k in ours if k in saved and saved[k] != ours[k]]
    return f"; model config differs from the checkpoint's: {', '.join(diffs)}" if diffs else ""


def _read_object_bytes(path: Path, index, unique_key: str) -> bytes | None:
    for key, info in index.storage_data.items():
        if key.fqn == unique_key and not getattr(info, "transform_descriptors", None):
            with open(path / info.relative_path, "rb") as fh:
                fh.seek(info.offset)
                return fh.read(info.length)
    return None


def _true_vocab_size(cfg) -> int:
    """The unpadded vocabulary: model.vocab_size, else the tokenizer's."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    from pretrain.data import build_tokenizer

    return build_tokenizer(cfg.data).vocab_size


def _check_requested(cfg, path: Path, index, common: dict, state: dict) -> None:
    """What this rank will load exists in the checkpoint with the right shape and safe contents."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    meta = index.state_dict_metadata
    for item in nested_values(state):
        if isinstance(item, ShardedTensor):
            found = meta.get(item.key)
            what = "optimizer state" if "optimizer." in item.key else "tensor"
            if found is None:
                raise CheckpointError(f"{path}: {what} '{item.key}' is not in the checkpoint"
                                      f"{_model_config_diff(cfg, common)}")
            if not isinstance(found, TensorStorageMetadata):
                raise CheckpointError(f"{path}: '{item.key}' is a pickled object in the checkpoint, "
                                      "expected a tensor")
            if item.allow_shape_mismatch and item.key.endswith(VOCAB_PADDED_KEYS):
                vocab = _true_vocab_size(cfg)
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
            data = _read_object_bytes(path, index, item.unique_key)
            if data is not None:
                try:
                    torch.load(io.BytesIO(data), weights_only=True)
                except Exception as exc:
                    raise CheckpointError(f"{path}: object '{item.unique_key}' refused by the weights-only "
                                          f"loader, untrusted pickles are never loaded ({_reason(exc)})") from None


def _agree(error: CheckpointError | None) -> None:
    """Raise the same error on every rank when a check failed on any rank (none is left waiting in a collective)."""
    from pretrain.runtime import any_rank_error

    message = any_rank_error(None if error is None else str(error))
    if message is not None:
        raise CheckpointError(message)


def inspect_checkpoint(path: str | Path) -> tuple[dict, Any]:
    """Common state and index of a checkpoint directory, checked without untrusted unpickling."""
    path = Path(path)
    _check_format(path)
    index = read_index(path)
    _check_files(path, index)
    return read_common(path, index), index


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


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


def load_checkpoint(cfg, model, optimizer, scheduler, path: Path, *, weights_only: bool = False) -> tuple[int, int]:
    """Load model (and unless `weights_only`, optimizer, schedule, RNG) from `path` (all ranks call this).

    Returns (step, consumed_samples); (0, 0) for a weights-only load. Raises CheckpointError naming the
    file and the mismatch for missing, truncated, foreign, unsafe or incompatible checkpoints.
    """
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    error, common, state = None, {}, {}
    try:
        common, index = inspect_checkpoint(path)
        with_optimizer = not weights_only and cfg.checkpoint.load_optimizer and "optimizer" in common
        same_layout = list(common.get("layout", [])) == list(_layout_key(cfg))
        state = _sharded_state(cfg, model, optimizer, scheduler, step=0, consumed_samples=0,
                               with_optimizer=with_optimizer, is_loading=True)
        if weights_only or not same_layout:
            state.pop("rng_state")
        if not with_optimizer:
            state.pop("optimizer", None)
            state.pop("opt_param_scheduler", None)
        _check_requested(cfg, path, index, common, state)
    except CheckpointError as exc:
        error = exc
    _agree(error)

    try:
        loaded = mcore.load_sharded(state, str(path), get_default_load_sharded_strategy(str(path)), read_common)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        raise CheckpointError(f"{path}: loading failed ({_reason(exc)})") from exc
    bad = _non_finite({k: v for k, v in loaded.items() if k.startswith(("model", "optimizer"))})
    _agree(CheckpointError(f"{path}: corrupt checkpoint, {bad}") if bad else None)
    for key in [k for k in loaded if k.startswith("model")]:
        index_ = 0 if key == "model" else int(key[5:])
        try:
            _unwrap(model[index_]).load_state_dict(loaded[key], strict=True)
        except RuntimeError as exc:
            raise CheckpointError(f"{path}: model weights do not fit this model ({_reason(exc)})") from None
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        try:
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
        except AssertionError as exc:
            raise CheckpointError(f"{path}: the LR schedule differs from the checkpoint's ({exc})") from None
    if "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    written_by = common.get("megatron_core")
    if written_by and written_by != str(mcore.MCORE) and dist.get_rank() == 0:
        print(f"[pretrain] {path} was written by megatron-core {written_by}, continuing with {mcore.MCORE}",
              flush=True)
    if weights_only:
        return 0, 0
    return int(loaded["iteration"]), int(loaded["consumed_samples"])


def start_from_checkpoint(cfg, model, optimizer, scheduler, log) -> tuple[int, int, bool]:
    """Resume from the run's own checkpoint, else load `checkpoint.pretrained` weights, else nothing (all ranks).

    Returns (step, consumed_samples, resumed). `log` prints on rank 0.
    """
    latest, note = find_resume(cfg)  # the tracker's, else the newest complete checkpoint
    if note:
        log(f"[pretrain] {note}")
    if latest is not None:
        step, consumed = load_checkpoint(cfg, model, optimizer, scheduler, latest)
        log(f"[pretrain] resumed from {latest} at step {step}")
        return step, consumed, True
    if cfg.checkpoint.pretrained:
        load_checkpoint(cfg, model, optimizer, scheduler, resolve_checkpoint(cfg.checkpoint.pretrained),
                        weights_only=True)
        # Distributed optimizer: main params are copies of the model params made at construction.
        optimizer.reload_model_params()
        log(f"[pretrain] loaded pretrained weights from {cfg.checkpoint.pretrained}")
    return 0, 0, False


def resolve_checkpoint(path: str | Path, iteration: int | None = None) -> Path:
    """An iteration directory from a run dir, a checkpoints dir or an iteration dir itself."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint or run directory")
    if (p / FORMAT_FILE).exists():
        return p
    for root in (p, p / "checkpoints"):
        if iteration is not None and iteration_dir(root, iteration).exists():
            return iteration_dir(root, iteration)
        latest = latest_iteration(root) if iteration is None else None
        if latest is not None:
            return iteration_dir(root, latest)
    what = f"iteration {iteration}" if iteration is not None else f"complete checkpoint ({TRACKER})"
    raise CheckpointError(f"{p}: no {what} found")


def read_saved_config(path: Path) -> dict:
    """The config a checkpoint was written with (from run_config.yaml)."""
    cfg_file = path / RUN_CONFIG_FILE
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no run_config.yaml beside the checkpoint")
    try:
        tree = yaml.safe_load(cfg_file.read_bytes().decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:  # e.g. a !!python tag: never constructed
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{cfg_file}: not a plain YAML config ({reason})") from None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{cfg_file}: expected a mapping of config sections, found {type(tree).__name__}")
    return tree

