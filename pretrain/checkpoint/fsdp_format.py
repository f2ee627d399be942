"""Megatron's `fsdp_dtensor` checkpoint format for Megatron-FSDP runs (optimizer.fsdp=true).

Megatron-FSDP state exists only as DTensors: megatron-core refuses it in torch_dist (`DistributedOptimizer.
sharded_state_dict` raises NotImplementedError for every sharding type but `fsdp_dtensor`), and the
fsdp_dtensor save/load itself lives in Megatron-LM's training loop, not in megatron-core. This module is our own
implementation on torch.distributed.checkpoint (DCP) and megatron-core's helpers (`fsdp_dtensor_checkpoint`,
`uneven_dtensor`), inside our checkpoint package: same directory, tracker, `run_config.yaml` commit, `common.pt`
and completeness checks as torch_dist (`format.py`); `metadata.json` names the backend `fsdp_dtensor`.

What the DCP files hold (Megatron-LM's key layout): `model.<param>` (DTensors, the SwiGLU `linear_fc1` split into
`_w`/`_v` halves by `handle_swiglu_in_state_dict`, experts under global indices), `optimizer.state.<name>.
{exp_avg,exp_avg_sq,step}` and `optimizer.param_to_group_meta`, and `rng_state.<rank>`. `common.pt` holds step,
consumed samples, config, layout, the LR schedule and `names`: every stored model key with the torch_dist key
and layer/expert index it corresponds to (what `cross_format.py` and the HF export read).

Three traps of the format are handled (shared/docs/cp_and_fsdp_on_cpu.md): a rank whose shard of a parameter is
empty has no optimizer state for it, so every rank is given an entry for every parameter (an empty DTensor) — the
per-DTensor collectives of `uneven_dtensor` would deadlock otherwise; entries follow the model's parameter order
on every rank (DCP reports out-of-bounds chunks otherwise); `handle_swiglu_in_state_dict` is called with the
MegatronFSDP module and one `module.` stripped from the optimizer's `module.module.` names.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.checkpoint import state as checkpoint_state
from pretrain.checkpoint import stateful
from pretrain.checkpoint.dropped import check_dropped
from pretrain.checkpoint.format import (
    COMMON_FILE,
    CheckpointError,
    agree,
    inspect_checkpoint,
    read_object_bytes,
    reason,
    write_format_file,
)
from pretrain.checkpoint.state import set_rng_state

FORMAT = "fsdp_dtensor"
OPTIMIZER_PREFIX = "module.module."  # the optimizer's names: adapter → MegatronFSDP → GPTModel
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")


def is_fsdp(model) -> bool:
    """True for Megatron-FSDP-wrapped model chunks."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    return isinstance(model[0], FullyShardedDataParallel)


def inner(model):
    """(MegatronFSDP module, GPTModel) of the single model chunk."""
    mfsdp = model[0].module
    return mfsdp, mfsdp.module


# --------------------------------------------------------------------------------------------------
# Names: each stored model key ↔ the torch_dist key (and leading layer / expert index) of the same tensor
# --------------------------------------------------------------------------------------------------


def _mapped(rest: str, keys_map: dict) -> str:
    for old, new in keys_map.items():  # Megatron's sharded_state_dict_keys_map (fused-norm names)
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def non_homogeneous(config) -> bool:
    """Whether Megatron-Core's `TransformerBlock.sharded_state_dict` keys each layer on its own
    (`decoder.layers.<i>.…`) rather than stacking the layers along dim 0: its rule (0.16.1–0.19) for layers of
    different kinds (MoE every few layers or by list, Gated DeltaNet layers, heterogeneous specs)."""
    def mixed(freq) -> bool:
        return isinstance(freq, list) or (isinstance(freq, int) and freq > 1)

    return bool(getattr(config, "hetereogenous_dist_checkpoint", False) or mixed(config.moe_layer_freq)
                or mixed(getattr(config, "linear_attention_freq", None))
                or getattr(config, "heterogeneous_block_specs", False))


def torch_dist_names(gpt) -> dict[str, tuple[str, list[int]]]:
    """{GPTModel parameter name: (torch_dist key, leading indices)}: layers stack along dim 0 (global layer
    index), experts along dim 1 (global expert index), as Megatron's sharded_state_dict lays them out; layers of
    different kinds (`non_homogeneous`) are keyed `decoder.layers.<i>.…`, experts then along dim 0."""
    from megatron.core.transformer.fsdp_dtensor_checkpoint import get_ep_layer_offset

    num_experts = getattr(gpt.config, "num_moe_experts", None)
    expert_offset = get_ep_layer_offset(num_experts) if num_experts else 0
    per_layer = non_homogeneous(gpt.config)
    names = {}
    for name, _ in gpt.named_parameters():
        m = _LAYER.match(name)
        if m is None:
            names[name] = (name, [])
            continue
        layer = gpt.decoder.layers[int(m.group(1))]
        keys_map = getattr(layer.submodules_config, "sharded_state_dict_keys_map", None) or {}
        rest = m.group(2)
        prefix, lead = (f"decoder.layers.{layer.layer_number - 1}.", []) if per_layer else \
            ("decoder.layers.", [layer.layer_number - 1])
        e = _EXPERT.match(rest)
        if e is not None:
            names[name] = (f"{prefix}mlp.experts.experts.{e.group(2)}", [*lead, int(e.group(1)) + expert_offset])
        else:
            names[name] = (f"{prefix}{_mapped(rest, keys_map)}", lead)
    return names


def stored_names(gpt) -> dict[str, list]:
    """{stored model key (after the expert renumbering and SwiGLU split): [torch_dist key, leading indices,
    half]} with half "w"/"v" for the SwiGLU halves of linear_fc1 (the torch_dist tensor is [w; v] on dim 0), or
    a `parts.Parts` for a tensor torch_dist stores in parts (`KEY.<part>`: Gated DeltaNet's in_proj, conv1d)."""
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

    from model_providers.core.linear_attention import stored_parts

    names = torch_dist_names(gpt)
    in_parts = stored_parts(gpt)
    num_experts = getattr(gpt.config, "num_moe_experts", None)
    renamed = handle_experts_in_state_dict({k: k for k in names}, num_experts) if num_experts else {k: k for k in names}
    out = {}
    for stored, local in renamed.items():
        key, lead = names[local]
        if gpt.config.gated_linear_unit and _is_swiglu(stored):
            out[f"{stored}_w"] = [key, lead, "w"]
            out[f"{stored}_v"] = [key, lead, "v"]
        elif local in in_parts:
            parts, tp = in_parts[local]
            out[stored] = [key, lead, {"parts": [list(p) for p in parts], "tp": tp}]
        else:
            out[stored] = [key, lead, None]
    return out


def all_stored_names(model) -> dict[str, list]:
    """`stored_names` of every rank merged (expert-parallel ranks hold different experts; collective)."""
    mine = stored_names(inner(model)[1])
    if dist.get_world_size() == 1 or not inner(model)[1].config.num_moe_experts:
        return mine
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged: dict[str, list] = {}
    for names in gathered:
        merged.update(names)
    return merged


def _is_swiglu(name: str) -> bool:
    return bool(re.search(r"\.mlp\.(experts\.local_experts\.\d+\.|shared_experts\.)?linear_fc1\.(weight|bias)$", name))


# --------------------------------------------------------------------------------------------------
# The state
# --------------------------------------------------------------------------------------------------


def global_expert_names(names: list[str], num_experts: int | None) -> dict[str, str]:
    """{local name: name with the global expert index} (Megatron's renaming, kept in the given order)."""
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

    if not num_experts:
        return {n: n for n in names}
    new_to_old = handle_experts_in_state_dict({n: n for n in names}, num_experts)
    old_to_new = {old: new for new, old in new_to_old.items()}
    return {n: old_to_new[n] for n in names}


def _complete_optimizer_state(model, state: dict) -> dict:
    """Every parameter in model order on every rank; an empty-shard parameter gets empty DTensors.

    Keys are the optimizer's names (global expert indices); the order is the model's on every rank.
    """
    steps = [float(s["step"]) for s in state.values() if isinstance(s, dict) and "step" in s]
    step = torch.tensor([max(steps) if steps else 0.0], dtype=torch.float64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    params = dict(model[0].named_parameters())
    renamed = global_expert_names(list(params), inner(model)[1].config.num_moe_experts)
    complete = {}
    for local, name in renamed.items():
        param = params[local]
        entry = state.get(name)
        if entry is None:
            entry = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        if "step" not in entry:
            entry["step"] = torch.tensor(step.item(), dtype=torch.float32)
        complete[name] = entry
    return complete


def dcp_state(ctx, *, with_optimizer: bool, is_loading: bool) -> tuple[dict, dict, dict | None]:
    """(DCP state dict, the model's own state dict, the optimizer's) for save or load (collective).

    The DCP state shares storage with the model and optimizer tensors: a DCP load writes into them in place.
    """
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_swiglu_in_state_dict

    model, optimizer = ctx.model, ctx.optimizer
    mfsdp, gpt = inner(model)
    raw_model = gpt.state_dict()
    model_sd = {k: v for k, v in raw_model.items() if not k.endswith("._extra_state")}
    raw_opt = None
    opt_sd = None
    if with_optimizer:
        raw_opt = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                               metadata={"distrib_optim_sharding_type": FORMAT})
        raw_opt["state"] = _complete_optimizer_state(model, raw_opt["state"])
        # handle_swiglu_in_state_dict strips one "module." and looks the name up on the MegatronFSDP module.
        opt_sd = dict(raw_opt)
    if gpt.config.gated_linear_unit:  # before the expert renaming: it looks the model's (local) names up
        model_sd, opt_sd = handle_swiglu_in_state_dict(mfsdp, model_sd, opt_sd)
    if gpt.config.num_moe_experts:  # global expert indices, renamed in place (the same order on every rank)
        renamed = global_expert_names(list(model_sd), gpt.config.num_moe_experts)
        model_sd = {renamed[k]: v for k, v in model_sd.items()}
    state = {"model": model_sd}
    if opt_sd is not None:
        state["optimizer"] = opt_sd
    preprocess_state_dict_for_uneven_dtensor(state)  # uneven shards' chunk metadata (collective per DTensor)
    return state, raw_model, raw_opt


def common_state(ctx, names: dict, *, step: int, consumed_samples: int, with_optimizer: bool) -> dict:
    """What rank 0 writes to common.pt (read back with the weights-only loader); `names`: all_stored_names.
    The run-level entries are torch_dist's (`stateful.common_fields`: schedule, step, config, tokenizer identity)."""
    common = {**stateful.common_fields(ctx, step=step, consumed_samples=consumed_samples),
              "format": FORMAT, "names": names}
    if with_optimizer:
        common["optimizer"] = {"param_state_sharding_type": FORMAT}
    return common


# --------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------


def save_request(ctx, path: Path, *, step: int, consumed_samples: int):
    """Plan the save of `path` on every rank and return Megatron-Core's AsyncRequest that writes it.

    The tensors are written by Megatron-Core's DCP writer (`FileSystemWriterAsync`, the same one torch_dist
    uses): `request.execute_sync()` writes now, `AsyncCallsQueue.schedule_async_request` in the background.
    Rank 0 writes `metadata.json` and `common.pt` before returning; the caller commits after the request.
    """
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
        save_state_dict_async_finalize,
        save_state_dict_async_plan,
    )
    from torch.distributed.checkpoint import DefaultSavePlanner

    model = ctx.model
    with_optimizer = ctx.settings.save_optimizer
    state, _, _ = dcp_state(ctx, with_optimizer=with_optimizer, is_loading=False)
    state["rng_state"] = {str(dist.get_rank()): checkpoint_state._rng_state()}
    names = all_stored_names(model)  # collective
    if dist.get_rank() == 0:
        write_format_file(path, FORMAT)
        torch.save(common_state(ctx, names, step=step, consumed_samples=consumed_samples,
                                with_optimizer=with_optimizer), path / COMMON_FILE)
    writer = FileSystemWriterAsync(str(path), thread_count=1)
    planned = save_state_dict_async_plan(state, writer, None, 0, planner=DefaultSavePlanner())
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    return AsyncRequest(save_fn, save_args, [lambda: save_state_dict_async_finalize(*planned[0])],
                        preload_fn=preload_fn)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def check_requested(path: Path, index, state: dict) -> None:
    """Every tensor this rank will load is in the checkpoint with the same global shape, every object is one and
    passes the weights-only loader (as `load.py` checks torch_dist checkpoints)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    flat, _ = flatten_state_dict(state)
    meta = index.state_dict_metadata
    for key, value in flat.items():
        found = meta.get(key)
        what = "optimizer state" if key.startswith("optimizer.") else "tensor" if torch.is_tensor(value) else "object"
        if found is None:
            raise CheckpointError(f"{path}: {what} '{key}' is not in the checkpoint")
        if torch.is_tensor(value):
            if not isinstance(found, TensorStorageMetadata):
                raise CheckpointError(f"{path}: '{key}' is a pickled object in the checkpoint, expected a tensor")
            if tuple(found.size) != tuple(value.shape):
                raise CheckpointError(f"{path}: {what} '{key}' has shape {list(found.size)} in the checkpoint but "
                                      f"{list(value.shape)} in this model")
        elif not isinstance(found, BytesStorageMetadata):
            raise CheckpointError(f"{path}: '{key}' is a tensor in the checkpoint, expected an object")
        else:  # what DCP would unpickle: through the weights-only loader first
            data = read_object_bytes(path, index, key)
            try:
                torch.load(io.BytesIO(data or b""), weights_only=True)
            except Exception as exc:
                raise CheckpointError(f"{path}: object '{key}' refused by the weights-only loader, untrusted pickles "
                                      f"are never loaded ({reason(exc)})") from None


def _local_non_finite(state: dict) -> str | None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    for key, value in flat.items():
        if torch.is_tensor(value) and value.is_floating_point():
            local = value.to_local() if hasattr(value, "to_local") else value
            bad = local.numel() - int(torch.isfinite(local).sum())
            if bad:
                return f"tensor '{key}' holds {bad} NaN/Inf values (of {local.numel()} on this rank)"
    return None


def load_tensors(ctx, path: Path, common: dict, index, *, weights_only: bool) -> tuple[int, int]:
    """Load an fsdp_dtensor checkpoint's tensors (model, optimizer, RNG) into Megatron-FSDP model chunks (all ranks).
    (step, consumed_samples)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    model, optimizer = ctx.model, ctx.optimizer
    with_optimizer = not weights_only and ctx.settings.load_optimizer and "optimizer" in common
    same_layout = list(common.get("layout", [])) == list(ctx.plan.layout_key())
    error = None
    state, raw_model, raw_opt = dcp_state(ctx, with_optimizer=with_optimizer, is_loading=True)
    if same_layout and not weights_only:
        state["rng_state"] = {str(dist.get_rank()): checkpoint_state._rng_state()}
    try:
        check_requested(path, index, state)
    except CheckpointError as exc:
        error = exc
    agree(error)
    try:
        dcp.load(state, storage_reader=FileSystemReader(str(path)), planner=DefaultLoadPlanner())
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        raise CheckpointError(f"{path}: loading failed ({reason(exc)})") from exc
    bad = _local_non_finite({k: v for k, v in state.items() if k in ("model", "optimizer")})
    agree(CheckpointError(f"{path}: corrupt checkpoint, {bad}") if bad else None)
    _, gpt = inner(model)
    try:  # the tensors were loaded in place; this installs them as Megatron-FSDP's compute weights
        gpt.load_state_dict(raw_model, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: model weights do not fit this model ({reason(exc)})") from None
    if with_optimizer:
        raw_opt["param_to_group_meta"] = state["optimizer"]["param_to_group_meta"]
        optimizer.load_state_dict(raw_opt)  # the schedule: load.py (this config's, at the checkpoint's step)
    if "rng_state" in state:
        set_rng_state(state["rng_state"][str(dist.get_rank())])
    if weights_only:
        return 0, 0
    return int(common["iteration"]), int(common["consumed_samples"])


# --------------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------------


def inspected(op: stateful.Io):
    """The checkpoint `op.path` checked (`format.inspect_checkpoint`, the same verdict on every rank): its common
    state into `op.common`; returns its index."""
    error, index = None, None
    try:
        op.common, index = inspect_checkpoint(op.path)
    except CheckpointError as exc:
        error = exc
    agree(error)
    return index


class FsdpDtensor:
    """The fsdp_dtensor backend (`backends.Backend`): Megatron-FSDP runs."""

    name = FORMAT

    def save(self, ctx, path: Path, op: stateful.Io, *, async_save: bool):
        request = save_request(ctx, path, step=op.step, consumed_samples=op.consumed_samples)
        if async_save:
            return request
        request.execute_sync()
        return None

    def load(self, ctx, op: stateful.Io) -> tuple[int, int]:
        index = inspected(op)
        check_dropped(ctx, op, index, self.model_names)
        return stateful.load_with_run_level(
            ctx, op, lambda: load_tensors(ctx, op.path, op.common, index, weights_only=op.weights_only))

    def check_requested(self, ctx, op: stateful.Io, index, state: dict) -> None:
        check_requested(op.path, index, state)

    def model_names(self, model) -> set[str]:
        """The model tensors this rank's chunks take, by torch_dist name."""
        from pretrain.checkpoint.parts import torch_dist_keys

        return {key for entry in stored_names(inner(model)[1]).values() for key in torch_dist_keys(entry)}

    def reload_main_params(self, ctx) -> None:
        """Nothing: Megatron-FSDP's main weights are the tensors the load wrote (megatron-core 0.19 raises on
        reload_model_params)."""
