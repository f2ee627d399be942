"""Process groups and devices: NCCL on GPU, gloo on CPU (the CPU shims are applied by `pretrain.compat.apply`)."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Runtime:
    """Where this process runs."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    on_gpu: bool
    backend: str

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.on_gpu else torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_world_size() -> int:
    """World size announced by the launcher (torchrun / our Slurm scripts), 1 without one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(timeout_minutes: float = 10.0) -> Runtime:
    """Join (or create) the default process group from torchrun-style environment variables."""
    from pretrain import compat

    on_gpu = torch.cuda.is_available()
    compat.apply(on_gpu)  # idempotent: train() already did; workers and tools that build Megatron objects too
    rank = int(os.environ.get("RANK", "0"))
    world_size = env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(local_rank)
    else:
        # Don't oversubscribe the cores with several ranks per host.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    return Runtime(rank, world_size, local_rank, local_world_size, on_gpu, backend)


def init_model_parallel(layout, seed: int) -> None:
    """Megatron-Core process groups for the run's `pretrain.layout.Layout`, and its model-parallel RNG seeds."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def any_rank_error(message: str | None) -> str | None:
    """The first error message of any rank, returned on every rank (collective; None when all are fine).

    One MAX all-reduce when every rank is fine; the messages are gathered only after a failure.
    """
    flag = torch.tensor([0.0 if message is None else 1.0])
    if torch.cuda.is_available():
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return None
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return next(m for m in messages if m is not None)


def reset_for_next_stage() -> None:
    """What a stage's training leaves in this process, gone before the next stage is built in it (as in a new
    process): Megatron's model-parallel groups (and their process groups, but the default one), global memory buffer,
    rerun state machine, microbatch calculator and RNG tracker, the MoE loss trackers; the old model is collected."""
    import contextlib
    import gc

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import unset_num_microbatches_calculator
    from torch.distributed import distributed_c10d as c10d

    from pretrain.observe import moe_metrics

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):  # Megatron's destroy only forgets its groups
        if group is not default:
            dist.destroy_process_group(group)
    parallel_state.destroy_global_memory_buffer()
    with contextlib.suppress(ImportError):
        from megatron.core.rerun_state_machine import destroy_rerun_state_machine

        destroy_rerun_state_machine()
    unset_num_microbatches_calculator()
    tensor_parallel.random.get_cuda_rng_tracker().reset()
    moe_metrics._forget_earlier_runs()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shutdown() -> None:
    """Tear down Megatron's groups and the default process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
