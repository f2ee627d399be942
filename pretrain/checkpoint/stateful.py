"""The pieces of a checkpoint as `Stateful` objects, each owning its save and load rule (TorchTitan's idea,
written for Megatron-Core's `dist_checkpointing`).

A `CheckpointContext` holds them in save order (`default_states`); the torch_dist save (`sharded_state`) and load
(`load.py`) iterate them instead of naming each:

- `ModelState`: the chunks' sharded tensors (global names, any layout; vocabulary rows may differ by TP padding);
- `OptimizerState`: built from the model's sharded state; saved with `checkpoint.save_optimizer`, loaded with
  `checkpoint.load_optimizer` when the checkpoint has it (the other optimizer's form: `optimizer_forms`);
- `RngState`: per-rank RNG states, restored only when the layout is the checkpoint's (`contract`: the reshard
  note) and never for a weights-only load;
- `ProgressState`: step, consumed samples (the data position), layout key, config;
- `SchedulerState`: the LR schedule; on load this config's schedule and hyperparameters are kept and only the
  step count is the checkpoint's (`contract.apply_new_schedule`);
- `RecordState`: the tokenizer identity the resume contract compares, the megatron-core release that wrote it
  (a load from another release says so), and the `RUN_STATE` providers (other parts' run-level state).

The first three are sharded; the rest are common state (`common.pt`, read back whole on load). Megatron-FSDP's
`fsdp_dtensor` format and loads across formats (`fsdp_format.py`, `cross_format.py`) build their tensor
state their own way (DCP state dicts of the FSDP-wrapped model; reading one format's files into the other's
names): they share the common state (`common_fields`) and the schedule and record rules only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

from pretrain.checkpoint import contract, optimizer_forms
from pretrain.checkpoint import state as checkpoint_state
from pretrain.checkpoint.format import CheckpointError, reason
from pretrain.checkpoint.state import OPTIMIZER_SHARDING
from pretrain.compat import mcore


@dataclass
class Io:
    """One save or load: what it is for. `common`: the checkpoint's common state (a load), else empty."""

    is_loading: bool
    step: int = 0
    consumed_samples: int = 0
    weights_only: bool = False
    path: Path | None = None
    common: dict = field(default_factory=dict)


class Stateful(Protocol):
    """A piece of a checkpoint: whether it takes part, what it adds to the state, how it loads back."""

    def included(self, ctx, op: Io) -> bool: ...

    def sharded_state_dict(self, ctx, state: dict, op: Io) -> dict: ...

    def load_state_dict(self, ctx, loaded: dict, op: Io) -> None: ...


class ModelState:
    def included(self, ctx, op: Io) -> bool:
        return True

    def sharded_state_dict(self, ctx, state: dict, op: Io) -> dict:
        return checkpoint_state.model_state(ctx.model, is_loading=op.is_loading)

    def load_state_dict(self, ctx, loaded: dict, op: Io) -> None:
        for key in [k for k in loaded if k.startswith("model")]:
            index = 0 if key == "model" else int(key[5:])
            try:
                checkpoint_state.unwrap(ctx.model[index]).load_state_dict(loaded[key], strict=True)
            except RuntimeError as exc:
                raise CheckpointError(f"{op.path}: model weights do not fit this model ({reason(exc)})") from None


class OptimizerState:
    def included(self, ctx, op: Io) -> bool:
        c = ctx.settings
        if not op.is_loading:
            return c.save_optimizer
        return not op.weights_only and c.load_optimizer and "optimizer" in op.common

    def sharded_state_dict(self, ctx, state: dict, op: Io) -> dict:
        """Built from the model's sharded state (`state`, what came before it)."""
        return {"optimizer": ctx.optimizer.sharded_state_dict(
            dict(state), is_loading=op.is_loading, metadata={"distrib_optim_sharding_type": OPTIMIZER_SHARDING})}

    def load_state_dict(self, ctx, loaded: dict, op: Io) -> None:
        ctx.optimizer.load_state_dict(optimizer_forms.convert_common(ctx.optimizer, loaded["optimizer"]))


class RngState:
    def included(self, ctx, op: Io) -> bool:
        if not op.is_loading:
            return True  # restored only at the same layout, never for weights only (the contract's reshard note)
        return not op.weights_only and list(op.common.get("layout", [])) == list(ctx.plan.layout_key())

    def sharded_state_dict(self, ctx, state: dict, op: Io) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        world, rank = dist.get_world_size(), dist.get_rank()
        return {"rng_state": ShardedObject("rng_state", checkpoint_state._rng_state(), (world,), (rank,),
                                           replica_id=0)}

    def load_state_dict(self, ctx, loaded: dict, op: Io) -> None:
        if "rng_state" in loaded:
            checkpoint_state.set_rng_state(loaded["rng_state"])


class ProgressState:
    """Step and consumed samples are read back by `load_checkpoint`'s caller (its return value)."""

    def included(self, ctx, op: Io) -> bool:
        return not op.is_loading  # common state: the load reads common.pt whole

    def sharded_state_dict(self, ctx, state: dict, op: Io) -> dict:
        plan = ctx.plan
        return {"iteration": op.step, "consumed_samples": op.consumed_samples, "layout": list(plan.layout_key()),
                "config": ctx.run_config()}

    def load_state_dict(self, ctx, loaded: dict, op: Io) -> None:
        pass


class SchedulerState:
    """Saved whenever there is a schedule (its step count is read on resume, also without optimizer state)."""

    def __init__(self) -> None:
        self.fresh: list[dict] | None = None  # this config's param-group settings, taken before a load

    def included(self, ctx, op: Io) -> bool:
        return ctx.scheduler is not None and not op.weights_only

    def sharded_state_dict(self, ctx, state: dict, op: Io) -> dict:
        if op.is_loading:  # nothing is read: the schedule is this config's; its hyperparameters, kept here
            self.fresh = contract.hyperparameters(ctx.optimizer)
            return {}
        return {"opt_param_scheduler": ctx.scheduler.state_dict()}

    def load_state_dict(self, ctx, loaded: dict, op: Io) -> None:
        common = op.common
        num_steps = (common.get("opt_param_scheduler") or {}).get("num_steps", common.get("iteration", 0))
        contract.apply_new_schedule(ctx.optimizer, ctx.scheduler, self.fresh, int(num_steps))


class RecordState:
    def included(self, ctx, op: Io) -> bool:
        return True

    def sharded_state_dict(self, ctx, state: dict, op: Io) -> dict:
        if op.is_loading:
            return {}
        tokenizer, record = ctx.plan.tokenizer, {}
        if tokenizer is not None and tokenizer.identity is not None:  # compared on resume
            record[contract.TOKENIZER_STATE] = tokenizer.record()
        elif tokenizer is not None and tokenizer.null:
            record[contract.TOKENIZER_STATE] = None  # a null tokenizer of unknown size: "no tokenizer"
        record["megatron_core"] = str(mcore.MCORE)  # the release that wrote it (any supported release reads it)
        for name, provider in checkpoint_state.RUN_STATE.items():  # read back by their owners
            value = provider()
            if value is not None:
                record[name] = value
        return record

    def load_state_dict(self, ctx, loaded: dict, op: Io) -> None:
        if not op.weights_only:  # the run-level state the checkpoint resumed from recorded, for its owners
            ctx.run_state = {name: op.common[name] for name in checkpoint_state.RUN_STATE if name in op.common}
        written_by = op.common.get("megatron_core")
        if written_by and written_by != str(mcore.MCORE) and dist.get_rank() == 0:
            print(f"[pretrain] {op.path} was written by megatron-core {written_by}, continuing with {mcore.MCORE}",
                  flush=True)


def default_states() -> list:
    """The pieces of a run's checkpoint, in the order their entries are written."""
    return [ModelState(), OptimizerState(), RngState(), ProgressState(), SchedulerState(), RecordState()]


COMMON = (ProgressState, SchedulerState, RecordState)  # the run-level pieces, whatever the format


def sharded_state(ctx, op: Io, only: tuple = ()) -> dict:
    """The torch_dist state of `ctx` (a `CheckpointContext`) for `op`: each included piece's entries, in order
    (`only`: these kinds of pieces)."""
    state: dict = {}
    for piece in ctx.states:
        if (not only or isinstance(piece, only)) and piece.included(ctx, op):
            state.update(piece.sharded_state_dict(ctx, state, op))
    return state


def common_fields(ctx, *, step: int, consumed_samples: int) -> dict:
    """The run-level entries of every checkpoint's common state, whatever its format (torch_dist, fsdp_dtensor)."""
    return sharded_state(ctx, Io(is_loading=False, step=step, consumed_samples=consumed_samples), only=COMMON)


def run_level(ctx, op: Io) -> list:
    """The run-level pieces a load of `op` applies (the fsdp_dtensor and cross-format loads: schedule, record)."""
    return [piece for piece in ctx.states if isinstance(piece, COMMON) and piece.included(ctx, op)]


def load_with_run_level(ctx, op: Io, load_tensors: Callable[[], tuple[int, int]]) -> tuple[int, int]:
    """A load whose tensors a format reads its own way (fsdp_dtensor, across formats): the run-level pieces
    (`run_level`: this config's schedule at the checkpoint's step, the record) around `load_tensors()`, which returns
    (step, consumed_samples)."""
    pieces = run_level(ctx, op)
    for piece in pieces:
        piece.sharded_state_dict(ctx, {}, op)
    step, consumed = load_tensors()
    for piece in pieces:
        piece.load_state_dict(ctx, {}, op)
    return step, consumed
