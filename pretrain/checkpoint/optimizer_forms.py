"""Loading optimizer state written by the other optimizer: `optimizer.distributed` toggled on resume.

Both forms keep Adam's moments under the same names (`optimizer.state.exp_avg.KEY`, `…exp_avg_sq.KEY`, KEY the
model tensor's name): the distributed optimizer in Megatron-Core's `fully_reshardable` format, the
non-distributed one through `optim_state_to_sharding_state`. They differ in where the fp32 main parameters
are (`optimizer.state.param.KEY` distributed, `optimizer.state.fp32_param.KEY` non-distributed with a 16-bit
model, the model weights themselves for an fp32 model) and in the shape of the common state (the param
groups, the Adam step). `map_keys` requests each missing main parameter where the checkpoint keeps it,
`fill_from_model` supplies those that are the model weights, and `convert_common` turns the common state
into the form this run's optimizer loads, its param groups paired with this run's (megatron-core 0.19 pairs
them by `max_lr`/`min_lr` too). Checked on megatron-core 0.16.1 and 0.19.2.
"""

from __future__ import annotations

import re

import torch

_MAIN_PARAM = re.compile(r"^((?:chained_\d+\.)?optimizer\.state\.)(param|fp32_param)\.(.+)$")


def _leaves(tree, path: tuple = ()):
    """(path, value) of every leaf of nested dicts and lists."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        if isinstance(value, (dict, list)):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


def _at(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _fits(found, item) -> bool:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not isinstance(found, TensorStorageMetadata) or found.properties.dtype != item.data.dtype:
        return False
    if not hasattr(item, "global_shape"):  # a ShardedTensorFactory (the fused SwiGLU fc1): built from its data
        return True
    if item.allow_shape_mismatch:  # vocabulary rows padded for another TP
        return tuple(found.size[1:]) == tuple(item.global_shape[1:])
    return tuple(found.size) == tuple(item.global_shape)


def _where(item, name: str) -> tuple:
    """Which shard of tensor `name` an item describes. Megatron-Core builds optimizer items as copies of the model
    items with another key (`dataclasses.replace`): a layer of a stacked tensor by its offset, a factory (the
    fused SwiGLU fc1) by its build function."""
    return name, tuple(getattr(item, "global_offset", ())), id(getattr(item, "build_fn", None))


def map_keys(state: dict, index) -> list[tuple[tuple, tuple]]:
    """Request main parameters missing from the checkpoint under the name it keeps them. Those that are the
    model weights are not requested twice (Megatron-Core refuses a key loaded twice): returns (optimizer path,
    model path) pairs for `fill_from_model`."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    tensors = (ShardedTensor, ShardedTensorFactory)
    meta = index.state_dict_metadata
    model_paths = {_where(v, v.key): p for p, v in _leaves({k: v for k, v in state.items() if k.startswith("model")})
                   if isinstance(v, tensors)}
    fills = []
    for path, item in list(_leaves(state.get("optimizer", {}), ("optimizer",))):
        match = _MAIN_PARAM.match(item.key) if isinstance(item, tensors) and item.key not in meta else None
        if match is None:
            continue
        prefix, kind, name = match.groups()
        other = f"{prefix}{'fp32_param' if kind == 'param' else 'param'}.{name}"
        if _fits(meta.get(other), item):
            item.key = other
        elif _where(item, name) in model_paths and _fits(meta.get(name), item):
            del _at(state, path[:-1])[path[-1]]
            fills.append((path, model_paths[_where(item, name)]))
    return fills


def fill_from_model(loaded: dict, fills: list[tuple[tuple, tuple]]) -> None:
    for opt_path, model_path in fills:
        _at(loaded, opt_path[:-1])[opt_path[-1]] = _at(loaded, model_path)


def _without(group: dict, *keys: str) -> dict:
    return {k: v for k, v in group.items() if k not in keys}


def _to_distributed(sub: dict) -> dict:
    """Common state written by the non-distributed optimizer, for the distributed one."""
    inner = sub["optimizer"] if "optimizer" in sub else sub  # mixed precision nests it; fp32 does not
    step = (inner.get("state") or {}).get("common_step", 0)
    step = float(step.item() if isinstance(step, torch.Tensor) else step)
    out = {"optimizer": {"param_groups": [{**_without(g, "params"), "step": step} for g in inner["param_groups"]]},
           "param_state": sub["param_state"], "param_state_sharding_type": "fully_reshardable"}
    if "grad_scaler" in sub:
        out["grad_scaler"] = sub["grad_scaler"]
    return out


def _to_non_distributed(sub: dict) -> dict:
    """Common state written by the distributed optimizer, for the non-distributed one."""
    saved = sub["optimizer"]["param_groups"]
    step = torch.tensor(float(saved[0].get("step", 0))) if saved else None
    if "fp32_from_fp16_params" in sub:  # mixed precision: {"optimizer": {state, param_groups}, ...}
        inner = sub["optimizer"]
        inner["param_groups"] = [_without(g, "step") for g in inner["param_groups"]]
    else:  # fp32: the torch optimizer's own {state, param_groups}
        requested = sub.get("param_groups") or [{} for _ in saved]
        inner = sub
        inner["param_groups"] = [{**_without(g, "step"), **r} for g, r in zip(saved, requested)]
        for key in ("optimizer", "param_state_sharding_type"):
            inner.pop(key, None)
    inner.setdefault("state", {})
    if step is not None:
        inner["state"]["common_step"] = step
    return sub


# Param-group keys that this run's config sets (the LR schedule's per-group bounds). megatron-core 0.19 pairs
# loaded groups with the optimizer's by them too (`param_group_identifier_keys`), so a changed optimizer.lr
# or min_lr would find no group; the pairing here uses the structural keys only (those of 0.16).
_CONFIG_GROUP_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")
_STRUCTURAL_GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "optimizer")


def _adopt_config_groups(sub_optimizer, sub: dict) -> None:
    """Give each loaded param group this run's values of `_CONFIG_GROUP_KEYS` (from the optimizer's group with
    the same structural keys), so that Megatron-Core pairs them; the resume contract then applies this
    config's hyperparameters (`contract.apply_new_schedule`)."""
    groups = (sub.get("optimizer") or {}).get("param_groups") or sub.get("param_groups") or []
    fresh = {tuple(g.get(k) for k in _STRUCTURAL_GROUP_KEYS): g for g in sub_optimizer.param_groups}
    for group in groups:
        mine = fresh.get(tuple(group.get(k) for k in _STRUCTURAL_GROUP_KEYS))
        for key in _CONFIG_GROUP_KEYS:
            if mine is not None and key in mine:
                group[key] = mine[key]


def convert_common(optimizer, loaded: dict | list) -> dict | list:
    """`loaded` (the optimizer part of a loaded checkpoint) in the form `optimizer` loads: converted when the
    checkpoint was written by the other kind of optimizer, its param groups paired with this run's."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = loaded if len(subs) > 1 else {0: loaded}
    keys = sorted(parts) if isinstance(parts, dict) else range(len(parts))
    for sub_optimizer, key in zip(subs, keys):
        sub = parts[key]
        written_distributed = "param_state_sharding_type" in sub
        if isinstance(sub_optimizer, DistributedOptimizer) and not written_distributed:
            parts[key] = _to_distributed(sub)
        elif not isinstance(sub_optimizer, DistributedOptimizer) and written_distributed:
            parts[key] = _to_non_distributed(sub)
        _adopt_config_groups(sub_optimizer, parts[key])
    return parts if len(subs) > 1 else parts[0]
