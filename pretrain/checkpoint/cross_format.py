"""Loading a checkpoint of the other format: torch_dist into a Megatron-FSDP run, fsdp_dtensor into a DDP run.

A run may switch between `optimizer.fsdp=true` and `optimizer.distributed=true` between restarts: the trainer
loads the newest checkpoint whatever its format (one line says so) and saves in its own format from then on.
Nothing is converted on disk. Both formats store every tensor under a global name (`fsdp_format.py`'s
`names` map in common.pt pairs the two namings), so each rank reads exactly the slice it holds: the rows of
its Megatron-FSDP shard, or the region of a torch_dist ShardedTensor (layers and experts stacked, the SwiGLU
`linear_fc1` as [w; v]). Weights, Adam moments, the fp32 master weights (torch_dist's `optimizer.state.param`;
Megatron-FSDP's model tensors are its fp32 masters), the step, the LR schedule and the data position carry over;
the per-rank RNG states do not (the formats store them differently; dropout-free runs do not use them).

Optimizer state crosses only between the two sharded optimizers (the distributed optimizer's
`fully_reshardable` layout and Megatron-FSDP's DTensors); `checkpoint.load_optimizer=false` takes the weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.checkpoint import fsdp_format
from pretrain.checkpoint.dropped import check_dropped
from pretrain.checkpoint.format import CheckpointError, agree, reason
from pretrain.checkpoint.parts import is_parts, part_to_whole, whole_to_parts
from pretrain.checkpoint.state import OPTIMIZER_SHARDING, unwrap
from pretrain.checkpoint.stateful import Io, ModelState, OptimizerState, load_with_run_level, sharded_state

_OPT_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.state\.(param|exp_avg|exp_avg_sq)\.(.*)$")
MOMENTS = ("exp_avg", "exp_avg_sq")


class ChunkReader:
    """Reads one region (offsets, sizes) of a tensor from a DCP checkpoint (torch_dist or fsdp_dtensor)."""

    def __init__(self, path: Path, index):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self.meta = {k: v for k, v in index.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self.reader = FileSystemReader(str(path))
        self.reader.set_up_storage_reader(index, True)

    def read(self, key: str, offsets: list[int], sizes: list[int]) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = self.meta.get(key)
        if md is None:
            raise CheckpointError(f"{self.path}: tensor '{key}' is not in the checkpoint")
        dest = torch.empty(sizes, dtype=md.properties.dtype)
        if dest.numel() == 0:
            return dest
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        items = create_read_items_for_chunk_list(key, md, [chunk])
        if sum(torch.Size(i.lengths).numel() for i in items) != dest.numel():
            raise CheckpointError(f"{self.path}: tensor '{key}' is incomplete in the checkpoint")
        self.reader.read_data(LoadPlan(items), IntoTensor(dest)).wait()
        return dest


class IntoTensor:
    """The smallest load planner for FileSystemReader.read_data: every read lands in one tensor."""

    def __init__(self, dest: torch.Tensor):
        self.dest = dest

    def resolve_tensor(self, req) -> torch.Tensor:
        t = self.dest
        for dim, (off, length) in enumerate(zip(req.dest_offsets, req.lengths)):
            t = t.narrow(dim, off, length)
        return t

    def commit_tensor(self, req, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, req, value) -> None:
        raise CheckpointError(f"unexpected object '{req.storage_index.fqn}' where a tensor was expected")


# --------------------------------------------------------------------------------------------------
# torch_dist → Megatron-FSDP
# --------------------------------------------------------------------------------------------------


def _local_chunk(dtensor) -> tuple[list[int], list[int]]:
    """(global offsets, sizes) of this rank's piece (the uneven-shard metadata fsdp_format attached)."""
    chunk = dtensor._local_tensor.__create_chunk_list__()[0]
    return list(chunk.offsets), list(chunk.sizes)


def _read_torch_dist(reader: ChunkReader, key: str, lead: list[int], half, offsets: list[int], sizes: list[int],
                     kind: str | None = None) -> torch.Tensor:
    """The region of torch_dist tensor `key` (its optimizer state `kind`: "param", "exp_avg", ...) at layer/expert
    `lead` that a Megatron-FSDP shard holds; a tensor stored in parts (`parts.Parts`) read part by part."""
    if is_parts(half):
        runs = whole_to_parts(half, offsets[0], offsets[0] + sizes[0]) or [(half["parts"][0][0], 0, 0)]  # or empty
        return torch.cat([_read_torch_dist(reader, f"{key}.{name}", lead, None, [a, *offsets[1:]],
                                           [b - a, *sizes[1:]], kind) for name, a, b in runs], dim=0)
    if kind is not None:
        key = _optimizer_key(reader, kind, key)
    md = reader.meta.get(key)
    if md is None:
        raise CheckpointError(f"{reader.path}: tensor '{key}' is not in the checkpoint")
    if half == "v":  # [w; v] on dim 0: v starts half-way
        offsets = [offsets[0] + md.size[len(lead)] // 2, *offsets[1:]]
    region = reader.read(key, [*lead, *offsets], [1] * len(lead) + sizes)
    return region.reshape(sizes)


def _optimizer_key(reader: ChunkReader, kind: str, key: str) -> str:
    for prefix in ("", "chained_0.", "chained_1."):
        candidate = f"{prefix}optimizer.state.{kind}.{key}"
        if candidate in reader.meta:
            return candidate
    raise CheckpointError(f"{reader.path}: optimizer state '{kind}' of '{key}' is not in the checkpoint")


def _torch_dist_step(path: Path, common: dict) -> float:
    groups = ((common.get("optimizer") or {}).get("optimizer") or {}).get("param_groups") or []
    steps = {float(g["step"]) for g in groups if "step" in g}
    if len(steps) != 1:
        raise CheckpointError(f"{path}: expected one optimizer step in the checkpoint's param groups, found "
                              f"{sorted(steps) or 'none'}")
    return steps.pop()


def _into_fsdp(ctx, path: Path, common: dict, index, with_optimizer: bool) -> None:
    model, optimizer = ctx.model, ctx.optimizer
    reader = ChunkReader(path, index)
    state, raw_model, raw_opt = fsdp_format.dcp_state(ctx, with_optimizer=with_optimizer, is_loading=True)
    _, gpt = fsdp_format.inner(model)
    names = fsdp_format.stored_names(gpt)
    step = _torch_dist_step(path, common) if with_optimizer else None
    for stored, tensor in state["model"].items():
        key, lead, half = names[stored]
        offsets, sizes = _local_chunk(tensor)
        source = "param" if with_optimizer else None  # the fp32 master
        tensor.to_local().copy_(_read_torch_dist(reader, key, lead, half, offsets, sizes, source))
        if with_optimizer:
            entry = state["optimizer"]["state"][fsdp_format.OPTIMIZER_PREFIX + stored]
            for kind in MOMENTS:
                value = _read_torch_dist(reader, key, lead, half, offsets, sizes, kind)
                entry[kind].to_local().copy_(value)
            entry["step"].fill_(step)
    gpt.load_state_dict(raw_model, strict=True)  # installs the weights as Megatron-FSDP's compute weights
    if with_optimizer:
        optimizer.load_state_dict(raw_opt)


# --------------------------------------------------------------------------------------------------
# fsdp_dtensor → Megatron DDP (+ distributed optimizer)
# --------------------------------------------------------------------------------------------------


def _fsdp_sources(common: dict) -> dict[tuple, dict]:
    """{(torch_dist key, lead...): {half or "": stored model key}} from the checkpoint's names map; a part of a
    tensor stored in parts: {"part": (stored model key, its `parts.Parts`, the part's name)}."""
    sources: dict[tuple, dict] = {}
    for stored, (key, lead, half) in common["names"].items():
        if is_parts(half):
            for name, _ in half["parts"]:
                sources[(f"{key}.{name}", *lead)] = {"part": (stored, half, name)}
        else:
            sources.setdefault((key, *lead), {})[half or ""] = stored
    return sources


def _read_fsdp(reader: ChunkReader, sources: dict, key: str, kind: str | None, lead: list[int],
               offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """The torch_dist region (`lead` + offsets/sizes) of `key` (or its optimizer state `kind`), from fsdp keys."""
    found = sources.get((key, *lead))
    if found is None:
        raise CheckpointError(f"{reader.path}: no tensor for '{key}' at {lead} in the checkpoint")

    def fsdp_key(stored: str) -> str:
        if kind in (None, "param"):
            return f"model.{stored}"
        return f"optimizer.state.{fsdp_format.OPTIMIZER_PREFIX}{stored}.{kind}"

    if "" in found:
        return reader.read(fsdp_key(found[""]), offsets, sizes)
    if "part" in found:  # rows of one part: runs of the whole tensor's rows, one per TP rank
        stored, spec, name = found["part"]
        return torch.cat([reader.read(fsdp_key(stored), [a, *offsets[1:]], [b - a, *sizes[1:]])
                          for a, b in part_to_whole(spec, name, offsets[0], offsets[0] + sizes[0]) or [(0, 0)]],
                         dim=0)
    rows = reader.meta[fsdp_key(found["w"])].size[0]  # [w; v]: rows below `rows` are w's
    start, stop = offsets[0], offsets[0] + sizes[0]
    parts = []
    for half, lo, hi in (("w", 0, rows), ("v", rows, 2 * rows)):
        a, b = max(start, lo), min(stop, hi)
        if a < b:
            parts.append(reader.read(fsdp_key(found[half]), [a - lo, *offsets[1:]], [b - a, *sizes[1:]]))
    return torch.cat(parts, dim=0)


def _fill(item, reader: ChunkReader, sources: dict):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    if isinstance(item, ShardedObject):
        return item.data
    if not isinstance(item, ShardedTensor):
        return item
    m = _OPT_KEY.match(item.key)
    key, kind = (m.group(3), m.group(2)) if m else (item.key, None)
    n = item.prepend_axis_num
    lead, offsets = list(item.global_offset[:n]), list(item.global_offset[n:])
    value = _read_fsdp(reader, sources, key, kind, lead, offsets, list(item.local_shape))
    value = value.to(item.dtype)
    if item.flattened_range is not None:
        value = value.flatten()[item.flattened_range]
    return value


def _into_ddp(ctx, path: Path, common: dict, index, with_optimizer: bool) -> None:
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    model, optimizer = ctx.model, ctx.optimizer

    reader = ChunkReader(path, index)
    sources = _fsdp_sources(common)
    # The tensor pieces only (per-rank RNG states do not cross formats); the optimizer's when `with_optimizer`.
    op = Io(is_loading=True, common=common if with_optimizer else {})
    requested = sharded_state(ctx, op, only=(ModelState, OptimizerState))
    state, nonpersistent, factories = load_preprocess(requested)
    dict_list_map_inplace(lambda item: _fill(item, reader, sources), state)
    state = apply_factory_merges(state, factories)
    merge(state, nonpersistent)
    for key in [k for k in state if k.startswith("model")]:
        unwrap(model[0 if key == "model" else int(key[5:])]).load_state_dict(state[key], strict=True)
    if with_optimizer:
        step = _fsdp_step(reader, common)
        for group in state["optimizer"]["optimizer"]["param_groups"]:
            group["step"] = step
        optimizer.load_state_dict(state["optimizer"])


def _fsdp_step(reader: ChunkReader, common: dict) -> float:
    stored = next(iter(common["names"]))
    key = f"optimizer.state.{fsdp_format.OPTIMIZER_PREFIX}{stored}.step"
    return float(reader.read(key, [], []).item())


class FsdpAsTorchDist:
    """An fsdp_dtensor checkpoint's model tensors under torch_dist names and shapes, read one layer (or layer,
    expert) slice at a time: what the HF export reads (`pretrain/hf/readers.py`)."""

    def __init__(self, path: Path, common: dict, index):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.reader = ChunkReader(path, index)
        self.sources = _fsdp_sources(common)
        self.tensors: dict = {}
        self.inner: dict[str, list[int]] = {}
        entries: dict[str, list] = {}
        for (key, *lead), halves in self.sources.items():
            entries.setdefault(key, []).append((lead, halves))
        for key, found in entries.items():
            lead, halves = found[0]
            if "part" in halves:  # one part of a tensor stored whole: its global rows
                stored, spec, name = halves["part"]
                md = self.reader.meta[f"model.{stored}"]
                inner = [dict(spec["parts"])[name], *md.size[1:]]
            else:
                md = self.reader.meta[f"model.{halves.get('') or halves['w']}"]
                inner = list(md.size)
            if "" not in halves and "part" not in halves:
                inner[0] *= 2  # [w; v]
            counts = [max(lead[i] for lead, _ in found) + 1 for i in range(len(lead))]
            self.inner[key] = inner
            self.tensors[key] = TensorStorageMetadata(properties=md.properties, size=torch.Size(counts + inner),
                                                      chunks=[])

    def read(self, key: str, lead: list[int]) -> torch.Tensor:
        inner = self.inner[key]
        return _read_fsdp(self.reader, self.sources, key, None, list(lead), [0] * len(inner), inner)


# --------------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------------


def crossing_refusal(c, o, path: Path, common: dict, into_fsdp: bool) -> CheckpointError | None:
    """Why the optimizer state of `path` (the other format than this run's, `common` its common state) cannot be
    loaded into this run's optimizer (Megatron-FSDP: `into_fsdp`; `c`, `o`: its checkpoint and optimizer sections),
    or None (`validate` asks too: `pretrain.checkpoint.resume.preview_start`)."""
    if not c.load_optimizer or "optimizer" not in common:
        return None
    source = "torch_dist" if into_fsdp else fsdp_format.FORMAT
    sharding = (common.get("optimizer") or {}).get("param_state_sharding_type")
    if sharding in (OPTIMIZER_SHARDING, fsdp_format.FORMAT) and (into_fsdp or o.distributed):
        return None
    return CheckpointError(
        f"{path}: optimizer state crosses between the distributed optimizer and Megatron-FSDP only; this "
        f"{source} checkpoint's optimizer state ({sharding or 'not sharded'}) does not fit this run's "
        f"optimizer. Fix: set optimizer.distributed=true, or checkpoint.load_optimizer=false to start from "
        "the weights with a fresh optimizer")


class AcrossFormats:
    """The backend (`backends.Backend`) that loads a checkpoint of the other format than this run's (`own`: the
    run's backend, which saves and names this run's tensors)."""

    def __init__(self, own) -> None:
        self.own = own
        self.name = own.name

    def save(self, ctx, path: Path, op: Io, *, async_save: bool):
        return self.own.save(ctx, path, op, async_save=async_save)  # a run saves in its own format

    def load(self, ctx, op: Io) -> tuple[int, int]:
        """Load `op.path` on every rank. Returns (step, consumed_samples)."""
        index = fsdp_format.inspected(op)
        check_dropped(ctx, op, index, self.own.model_names)
        return load_with_run_level(ctx, op, lambda: self._load_tensors(ctx, op, index))

    def check_requested(self, ctx, op: Io, index, state: dict | None = None) -> None:
        """What crosses: optimizer state only between the two sharded optimizers (`crossing_refusal`); each tensor
        this rank reads is checked as it is read (`ChunkReader`)."""
        if self._with_optimizer(ctx, op):
            error = crossing_refusal(ctx.settings, ctx.plan.cfg.optimizer, op.path, op.common, self._fsdp_run(ctx))
            if error is not None:
                raise error

    def model_names(self, model) -> set[str]:
        return self.own.model_names(model)

    def reload_main_params(self, ctx) -> None:
        self.own.reload_main_params(ctx)

    @staticmethod
    def _fsdp_run(ctx) -> bool:
        return fsdp_format.is_fsdp(ctx.model)

    @staticmethod
    def _with_optimizer(ctx, op: Io) -> bool:
        return not op.weights_only and ctx.settings.load_optimizer and "optimizer" in op.common

    def _load_tensors(self, ctx, op: Io, index) -> tuple[int, int]:
        from torch.distributed.checkpoint.api import CheckpointException

        path, common = op.path, op.common
        into_fsdp, with_optimizer = self._fsdp_run(ctx), self._with_optimizer(ctx, op)
        source = "torch_dist" if into_fsdp else fsdp_format.FORMAT
        error = None
        try:
            self.check_requested(ctx, op, index)
        except CheckpointError as exc:
            error = exc
        agree(error)
        distributed = ctx.plan.cfg.optimizer.distributed
        target = "Megatron-FSDP" if into_fsdp else "the distributed optimizer" if distributed else "DDP"
        if dist.get_rank() == 0:
            print(f"[pretrain] {path} is in the {source} format: loading it into {target} (per-rank RNG states are "
                  "not carried across formats)", flush=True)
        try:
            if into_fsdp:
                _into_fsdp(ctx, path, common, index, with_optimizer)
            else:
                _into_ddp(ctx, path, common, index, with_optimizer)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(f"{path}: loading the {source} checkpoint into {target} failed "
                                  f"({reason(exc)})") from exc
        if op.weights_only:
            return 0, 0
        return int(common["iteration"]), int(common["consumed_samples"])
