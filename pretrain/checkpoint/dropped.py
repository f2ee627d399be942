"""Checkpoint weights this model does not take: refused, or (`checkpoint.allow_dropped_weights=true`) printed in one
line and recorded in `run.dir/dropped_weights.json`.

A load reads what this model asks for (a tensor it asks for and the checkpoint lacks is refused by `load.py`,
`fsdp_format.check_requested` and `cross_format`); a checkpoint tensor nobody asks for would be skipped without a
word, e.g. learned attention sinks loaded into `model.softmax_type=vanilla`, an MTP block into a model without
one, an untied output layer into tied embeddings. Names are compared in torch_dist's global naming, whatever the
format on disk, over the model chunks of every rank (one all-gather), for resumes and pretrained weights alike.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
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


def target_names(local_names: set[str]) -> set[str]:
    """The model tensors the chunks of every rank take, from this rank's (`local_names`; collective)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(local_names))
    return {name for names in everyone for name in names}


def check_dropped(ctx, op, index, model_names: Callable[[list], set[str]]) -> list[str]:
    """Refuse a load (`op`: a `stateful.Io`, its checkpoint's common state read) that would leave checkpoint tensors
    behind, unless `checkpoint.allow_dropped_weights`: then one line (rank 0) and the record. `model_names`: the
    backend's torch_dist names of the tensors this rank's chunks take. Returns the dropped names (all ranks;
    collective)."""
    path, common, weights_only = op.path, op.common, op.weights_only
    dropped = sorted(source_names(common, index) - target_names(model_names(ctx.model)))
    if not dropped:
        return []
    shown = ", ".join(dropped[:SHOWN]) + (f" (and {len(dropped) - SHOWN} more)" if len(dropped) > SHOWN else "")
    what = f"{len(dropped)} tensor{'s' if len(dropped) > 1 else ''} of the checkpoint"
    if not ctx.settings.allow_dropped_weights:
        raise CheckpointError(f"{path}: {what} {'have' if len(dropped) > 1 else 'has'} no place in this model and "
                              f"would be dropped: {shown}{model_config_diff(ctx.plan.cfg.model, common)}; set "
                              "checkpoint.allow_dropped_weights=true to load without them")
    if dist.get_rank() == 0:
        print(f"[pretrain] {path}: {what} left out, this model has no place for "
              f"{'them' if len(dropped) > 1 else 'it'} "
              f"(checkpoint.allow_dropped_weights=true; listed in run.dir/{RECORD_FILE}): {shown}", flush=True)
        _record(ctx.run_dir, path, dropped, weights_only)
    return dropped


def model_config_diff(m, common: dict) -> str:
    """'; model config differs from the checkpoint's: KEY OLD → NEW, ...' or '' (`m`: this run's model section)."""
    saved = (common.get("config") or {}).get("model") or {}
    ours = dataclasses.asdict(m)
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
