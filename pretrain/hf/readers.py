"""Reading both sides of the bridge one tensor at a time: torch_dist checkpoints (a layer slice per read) and
HF safetensors directories (the file opened per read: no lingering mmap)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from model_providers.core.mapping import ConversionError, Index
from pretrain import safe_paths
from pretrain.hf.files import SAFETENSORS_DTYPES, lead_offsets

# Optimizer state keys; MoE models chain a dense and an expert optimizer (`chained_<i>.optimizer...`).
_OPTIMIZER_STATE = re.compile(r"(chained_\d+\.)?optimizer\.")


class CheckpointReader:
    """Reads single tensors (or one layer slice of a stacked tensor) from a torch_dist checkpoint, or from an
    fsdp_dtensor one under the same names (`pretrain.checkpoint.cross_format.FsdpAsTorchDist`)."""

    def __init__(self, path: Path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from pretrain.checkpoint.format import checkpoint_backend, inspect_checkpoint

        self.path = path
        common, self.metadata = inspect_checkpoint(path)  # format, allow-listed index, files present and long enough
        self.fsdp = None
        if checkpoint_backend(path) == "fsdp_dtensor":  # Megatron-FSDP's: read under torch_dist names
            from pretrain.checkpoint.cross_format import FsdpAsTorchDist

            self.fsdp = FsdpAsTorchDist(path, common, self.metadata)
            self.tensors = self.fsdp.tensors
            return
        self.reader = FileSystemReader(str(path))
        self.reader.set_up_storage_reader(self.metadata, True)
        self.tensors = {
            k: v for k, v in self.metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and not _OPTIMIZER_STATE.match(k) and "_extra_state" not in k
        }

    def read(self, key: str, layer: Index = None) -> torch.Tensor:
        """The whole tensor `key`, or its slice `layer` along dim 0 (a (layer, expert) tuple: dims 0 and 1)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        from pretrain.checkpoint.cross_format import IntoTensor

        if self.fsdp is not None:
            return self.fsdp.read(key, lead_offsets(layer))
        md = self.tensors[key]
        size = list(md.size)
        offsets = [0] * len(size)
        lead = lead_offsets(layer)
        for dim, i in enumerate(lead):
            offsets[dim], size[dim] = i, 1
        dest = torch.empty(size, dtype=md.properties.dtype)
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(size))
        items = create_read_items_for_chunk_list(key, md, [chunk])
        covered = sum(torch.Size(i.lengths).numel() for i in items)
        if covered != dest.numel():
            raise ConversionError(f"{self.path}: tensor '{key}' is incomplete in the checkpoint "
                                  f"({covered} of {dest.numel()} elements stored)")
        self.reader.read_data(LoadPlan(items), IntoTensor(dest)).wait()
        return dest.reshape(dest.shape[len(lead):])


def load_run_config(ckpt: Path):
    """The `Config` the checkpoint was saved with (run_config.yaml beside it)."""
    from pretrain.checkpoint.format import read_saved_config
    from pretrain.config import config_from_dict

    return config_from_dict(read_saved_config(ckpt))


class HFReader:
    """Reads single tensors from a safetensors model directory (opening the file per read: no lingering mmap).

    Every file is found through `pretrain.safe_paths`: an index naming an absolute path, a `../` path or a
    symlink that leaves the directory (other than into an HF cache's blobs) is refused."""

    def __init__(self, directory: Path):
        self.dir = directory
        index_name = "model.safetensors.index.json"
        if safe_paths.present(directory, index_name):
            try:
                weight_map = json.loads(safe_paths.read_bytes(directory, index_name))["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ConversionError(f"{directory / index_name}: not a safetensors index ({exc!r})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ConversionError(f"{directory / index_name}: weight_map is not a mapping of tensor names to "
                                      "file names")
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                bins = sorted(p.name for p in directory.glob("*.bin"))
                hint = f" (found {bins[0]}; only safetensors are read: pickled .bin files can run code)" if bins else ""
                raise ConversionError(f"{directory}: no *.safetensors weights{hint}")
            weight_map = {}
            for name in files:
                with _open_safetensors(self._path(name, "a weights file")) as st:
                    weight_map.update({k: name for k in st.keys()})
        self.weight_map: dict[str, str] = weight_map
        self.paths: dict[str, Path] = {}
        self.info: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for fname in sorted(set(weight_map.values())):
            self.paths[fname] = path = self._path(fname, f"named by {index_name}")
            with _open_safetensors(path) as st:
                for k in st.keys():
                    sl = st.get_slice(k)
                    self.info[k] = (tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), k))

    def _path(self, name: str, what: str) -> Path:
        try:
            return safe_paths.inside(self.dir, name, what)
        except FileNotFoundError:
            raise ConversionError(f"{self.dir / name}: listed in the index but missing") from None

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.paths[self.weight_map[name]]), "pt") as st:
            return st.get_tensor(name)


def _open_safetensors(path: Path):
    """`safe_open`, with a truncated or foreign file reported as one line naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), "pt")
    except (SafetensorError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConversionError(f"{path}: not a readable safetensors file, truncated or corrupt ({reason})") from None


def _st_dtype(code: str, name: str) -> torch.dtype:
    for dt, c in SAFETENSORS_DTYPES.items():
        if c == code:
            return dt
    raise ConversionError(f"HF tensor '{name}': unsupported safetensors dtype {code}")
