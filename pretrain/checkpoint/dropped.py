"""Checkpoint weights this model does not take: refused, or (`checkpoint.allow_dropped_weights=true`) printed in one
line and recorded in `run.dir/dropped_weights.json`.

A load reads what this model asks for (a tensor it asks for and the checkpoint lacks is refused by `load.py`,
`fsdp_format.check_requested` and `cross_format`); a checkpoint tensor nobody asks for would be skipped without a
word, e.g. learned attention sinks loaded into `model.softmax_type=vanilla`, an MTP block into a model without
one, an untied output layer into tied embeddings. Names are compared in torch_dist's global naming, whatever the
format on disk, over the model chunks of every rank (one all-gather), for resumes and pretrained weights alike.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch.distributed as dist

from pretrain.checkpoint.format import CheckpointError
from pretrain.files import write_atomic

RECORD_FILE = "dropped_weights.json"
SHOWN = 8  # names printed; the record lists them all


def source_names(common: dict, index) -> set[str]:
    """The model tensors a checkpoint holds, by torch_dist name (an fsdp_dtensor checkpoint: its names map)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from pretrain.checkpoint.parts import torch_dist_keys

    if isinstance(common.get("names"), dict):  # fsdp_dtensor: stored key -> [torch_dist key, lead, half]
        return {key for entry in common["names"].values() for key in torch_dist_keys(entry)}
    return {key for key, meta in index.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata) and "optimizer." not in key}


def _local_names(model) -> set[str]:
    """The model tensors this rank's chunks take, by torch_dist name."""
    from pretrain.checkpoint import fsdp_format

    if fsdp_format.is_fsdp(model):
        from pretrain.checkpoint.parts import torch_dist_keys

        names = fsdp_format.stored_names(fsdp_format.inner(model)[1])
        return {key for entry in names.values() for key in torch_dist_keys(entry)}
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from pretrain.checkpoint.state import model_state

    # A factory is stored under the keys of the tensors it builds, which may differ from its own: Mamba's and Gated
    # DeltaNet's fused in_proj / conv1d are stored as one tensor per part (`...in_proj.weight.z`, `.x`, `.B`, `.C`,
    # `.dt`; `.query`, `.key`, ...).
    state = model_state(model, is_loading=True)
    apply_factories(state)  # views of the parameters, as the load itself builds them
    return {item.key for item in nested_values(state) if isinstance(item, ShardedTensor)}


def target_names(model) -> set[str]:
    """The model tensors the chunks of every rank take (collective)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(_local_names(model)))
    return {name for names in everyone for name in names}


def check_dropped(ctx, path: Path, common: dict, index, *, weights_only: bool) -> list[str]:
    """Refuse a load that would leave checkpoint tensors behind, unless `checkpoint.allow_dropped_weights`: then
    one line (rank 0) and the record. Returns the dropped names (all ranks; collective)."""
    dropped = sorted(source_names(common, index) - target_names(ctx.model))
    if not dropped:
        return []
    shown = ", ".join(dropped[:SHOWN]) + (f" (and {len(dropped) - SHOWN} more)" if len(dropped) > SHOWN else "")
    what = f"{len(dropped)} tensor{'s' if len(dropped) > 1 else ''} of the checkpoint"
    if not ctx.cfg.checkpoint.allow_dropped_weights:
        raise CheckpointError(f"{path}: {what} {'have' if len(dropped) > 1 else 'has'} no place in this model and "
                              f"would be dropped: {shown}{model_config_diff(ctx.cfg, common)}; set "
                              "checkpoint.allow_dropped_weights=true to load without them")
    if dist.get_rank() == 0:
        print(f"[pretrain] {path}: {what} left out, this model has no place for "
              f"{'them' if len(dropped) > 1 else 'it'} "
              f"(checkpoint.allow_dropped_weights=true; listed in run.dir/{RECORD_FILE}): {shown}", flush=True)
        _record(ctx.cfg.run.dir, path, dropped, weights_only)
    return dropped


def model_config_diff(cfg, common: dict) -> str:
    """'; model config differs from the checkpoint's: KEY OLD → NEW, ...' or ''."""
    saved = (common.get("config") or {}).get("model") or {}
    ours = cfg.to_dict()["model"]
    diffs = [f"{k} {saved[k]!r} → {ours[k]!r}" for k in ours if k in saved and saved[k] != ours[k]]
    return f"; model config differs from the checkpoint's: {', '.join(diffs)}" if diffs else ""


def _record(run_dir: str | Path, path: Path, dropped: list[str], weights_only: bool) -> None:
    """Append this load to run.dir/dropped_weights.json (every load that dropped weights, oldest first)."""
    record_path = Path(run_dir) / RECORD_FILE
    try:
        loads = json.loads(record_path.read_text())["loads"]
    except (OSError, ValueError, KeyError, TypeError):
        loads = []
    loads.append({"checkpoint": str(path), "load": "pretrained weights" if weights_only else "resume",
                  "allowed_by": "checkpoint.allow_dropped_weights=true", "dropped": dropped,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    record_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(record_path, json.dumps({"loads": loads}, indent=1) + "\n")
