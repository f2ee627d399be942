"""Writing both sides of the bridge as tensors are produced: safetensors shards with headers planned up front,
and a torch.distributed.checkpoint save planner whose data is made only when the writer asks for it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import torch

from model_providers.core.mapping import ConversionError
from pretrain.hf.files import SAFETENSORS_DTYPES


@dataclasses.dataclass
class TensorEntry:
    """One planned safetensors tensor: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


class ShardedSafetensorsWriter:
    """Writes tensors, in a fixed planned order, into `model-0000i-of-0000n.safetensors` shards.

    Headers are computed from the plan before any data arrives, so each tensor is written as soon as
    it is produced and then dropped. `close()` writes model.safetensors.index.json (its `metadata`: the total size
    and `metadata`).
    """

    def __init__(self, directory: Path, entries: list[TensorEntry], max_shard_bytes: int,
                 metadata: dict[str, str] | None = None):
        self.dir, self.entries, self.metadata = directory, entries, metadata or {}
        shards: list[list[TensorEntry]] = [[]]
        size = 0
        for e in entries:
            if shards[-1] and size + e.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(e)
            size += e.nbytes
        n = len(shards)
        self.shards = [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", s) for i, s in enumerate(shards)]
        self.order = [e.name for e in entries]
        self.position = 0
        self.shard_index = -1
        self.file = None
        self.remaining: list[str] = []

    def _open_next(self) -> None:
        if self.file is not None:
            self.file.close()
        self.shard_index += 1
        fname, entries = self.shards[self.shard_index]
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for e in entries:
            header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.file = open(self.dir / fname, "wb")
        self.file.write(len(blob).to_bytes(8, "little"))
        self.file.write(blob)
        self.remaining = [e.name for e in entries]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        entry = self.entries[self.position]
        if name != entry.name or tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise ConversionError(f"internal: tensor '{name}' {tuple(tensor.shape)} {tensor.dtype} does not match "
                                  f"the plan ('{entry.name}' {entry.shape} {entry.dtype})")
        if not self.remaining:
            self._open_next()
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.write(memoryview(data))
        self.remaining.pop(0)
        self.position += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.position != len(self.entries):
            raise ConversionError(f"internal: {len(self.entries) - self.position} planned tensors were not written")
        total = sum(e.nbytes for e in self.entries)
        weight_map = {e.name: fname for fname, entries in self.shards for e in entries}
        index = {"metadata": {"total_size": total, **self.metadata}, "weight_map": weight_map}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


class StreamingSavePlanner:
    """A torch.distributed.checkpoint SavePlanner over planned write items whose data is made on demand."""

    def __init__(self, items: list, resolve: Callable):
        self.items, self.resolve = items, resolve

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self):
        from torch.distributed.checkpoint.planner import SavePlan

        return SavePlan(self.items)

    def create_global_plan(self, all_plans):
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan):
        return new_plan

    def resolve_data(self, write_item):
        return self.resolve(write_item)


def writer_class():
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Writer(FileSystemWriter):
        """FileSystemWriter recording the final directory (a str: no pathlib objects in the index)."""

        final_id = ""

        def storage_meta(self) -> StorageMeta:
            return StorageMeta(checkpoint_id=self.final_id, save_id=self.save_id)

    return Writer
