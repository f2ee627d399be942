"""What a checkpoint holds: the sharded state of model, optimizer and schedule, step, config and RNG states.

Model and optimizer (the distributed optimizer in the `fully_reshardable` format) are sharded tensors keyed
by global names, so a checkpoint loads at any TP/PP/VP/DP layout. The LR schedule, step, consumed samples,
config, the tokenizer's identity and per-rank RNG states (Python, NumPy, torch, Megatron's RNG tracker) make a
same-layout resume exact.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from pretrain.checkpoint.contract import TOKENIZER_STATE
from pretrain.compat import mcore

OPTIMIZER_SHARDING = "fully_reshardable"


def unwrap(chunk):
    return getattr(chunk, "module", chunk)


# Vocabulary-sized tensors: their rows are padded to a multiple of make_vocab_size_divisible_by × TP, so a
# checkpoint written at another TP may hold more or fewer (all-zero) padding rows. Loading reads the rows both
# have; `_check_requested` still insists on the real vocabulary and equal other dimensions.
VOCAB_PADDED_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def model_state(model, is_loading: bool = False) -> dict:
    """Sharded state of the (DDP-unwrapped) chunks: storage keys are the model's global names."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    # The data-parallel group Megatron-Core's modules default to, passed explicitly: 0.16's GPTModel reads
    # metadata['dp_cp_group'] itself for an MTP stage's embedding copy (pipeline parallel with MTP).
    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if len(model) == 1:
        state = {"model": unwrap(model[0]).sharded_state_dict(metadata=metadata)}
    else:
        state = {f"model{i}": unwrap(chunk).sharded_state_dict(metadata=dict(metadata))
                 for i, chunk in enumerate(model)}
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


def set_rng_state(rng: dict) -> None:
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


def sharded_state(ctx, *, step: int, consumed_samples: int, with_optimizer: bool, is_loading: bool) -> dict:
    """The torch_dist state of `ctx` (a `CheckpointContext`): model chunks, optimizer, per-rank RNG, common fields."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model, optimizer = ctx.model, ctx.optimizer

    state = model_state(model, is_loading=is_loading)
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state),
            is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": OPTIMIZER_SHARDING},
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    state["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    state.update(common_fields(ctx, step=step, consumed_samples=consumed_samples))
    return state


def common_fields(ctx, *, step: int, consumed_samples: int) -> dict:
    """The run-level entries of every checkpoint's common state, whatever its format (torch_dist, fsdp_dtensor)."""
    plan, scheduler = ctx.plan, ctx.scheduler
    common = {"iteration": step, "consumed_samples": consumed_samples, "layout": list(plan.layout_key()),
              "config": plan.cfg.to_dict()}
    if scheduler is not None:  # its step count is read on resume, also without optimizer (None: weights only)
        common["opt_param_scheduler"] = scheduler.state_dict()
    if plan.tokenizer is not None and plan.tokenizer.identity is not None:  # compared on resume
        common[TOKENIZER_STATE] = plan.tokenizer.record()
    elif plan.tokenizer is not None and plan.tokenizer.null:
        common[TOKENIZER_STATE] = None  # a null tokenizer of unknown size: "no tokenizer"
    common["megatron_core"] = str(mcore.MCORE)  # the release that wrote it (any supported release reads it)
    return common
