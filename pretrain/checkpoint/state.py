"""What a checkpoint holds: the sharded state of model, optimizer and schedule, step, config and RNG states.

Model and optimizer (the distributed optimizer in the `fully_reshardable` format) are sharded tensors keyed
by global names, so a checkpoint loads at any TP/PP/VP/DP layout. The LR schedule, step, consumed samples,
config, the tokenizer's identity and per-rank RNG states (Python, NumPy, torch, Megatron's RNG tracker) make a
same-layout resume exact. The pieces and their save and load rules: `stateful.py`; here the model's sharded
state and the RNG states they use.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

OPTIMIZER_SHARDING = "fully_reshardable"
# Run-level state other parts of the run keep in every checkpoint's common state: name -> a callable returning it
# (None: nothing to save). Registered by their owners; a resume reads the checkpoint's common state once and hands
# each entry back (`CheckpointContext.run_state`: `pretrain.resilience.hooks`, the result checks' spike window and
# maximum; `pretrain.stages.boundaries`, the stage the checkpoint was written in).
RUN_STATE: dict[str, Callable[[], dict | None]] = {}


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
