"""Megatron-Core APIs that differ between the supported releases (0.16.1 – 0.19.x), one adapter each.

The installed release is read once (from the package metadata: `megatron.core.__version__` gains a
`+<git hash>` suffix when the package sits inside a git checkout) and each adapter is chosen by
`_pick` below. Callers import the adapter, never the version: releases are compared only inside
`pretrain/compat/` (here, `matrix.py`, and the `since`/`fixed_in` of each CPU shim and Megatron fix).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TypeVar

from packaging.version import Version

SUPPORTED_MIN = Version("0.16.1")
SUPPORTED_BELOW = Version("0.20")


def installed_version() -> Version:
    """The installed megatron-core release (raises PackageNotFoundError when it is not installed)."""
    return Version(metadata.version("megatron-core"))


MCORE = installed_version()


T = TypeVar("T")


def _pick(impls: dict[str, T]) -> T:
    """The implementation for the newest release in `impls` that is not newer than the installed one."""
    chosen = None
    for since, impl in sorted(impls.items(), key=lambda kv: Version(kv[0])):
        if Version(since) <= MCORE:
            chosen = impl
    if chosen is None:  # older than every listed release: validation refuses it; use the oldest
        chosen = min(impls.items(), key=lambda kv: Version(kv[0]))[1]
    return chosen


# --------------------------------------------------------------------------------------------------
# Context-parallel batch slicing: `megatron.core.utils.get_batch_on_this_cp_rank`
#   0.16–0.17: (batch, cp_group=None); None means parallel_state's CP group.
#   0.18+:     (batch, is_hybrid_cp, cp_group=None, ...); is_hybrid_cp is required, and a None cp_group
#              reaches torch.distributed as the WORLD group, so the CP group is always passed.
# --------------------------------------------------------------------------------------------------


def _cp_batch_0_16(batch: dict) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(batch, cp_group=ps.get_context_parallel_group())


def _cp_batch_0_18(batch: dict) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group())


# --------------------------------------------------------------------------------------------------
# Distributed checkpoints: `megatron.core.dist_checkpointing.save` / `load`
#   save, 0.17+: `async_strategy` defaults to "nvrx" (needs nvidia-resiliency-ext and its own queue);
#                our queue is Megatron's `AsyncCallsQueue`, so "mcore" is asked for.
#   load: where the common (non-sharded) state comes from, always through the caller's weights-only
#         reader `read_common(path)`:
#     0.16:      the `common_strategy=` argument (a `LoadCommonStrategy`);
#     0.17–0.18: the argument must be None; `serialization.load_common(dir)` reads `common.pt`;
#     0.19+:     `serialization.load_common_state_dict(dir)` reads the `common_state` object inside the
#                torch_dist files (or a legacy `common.pt`) — with `weights_only=False` for the former.
#   0.17+ keep reading `common.pt` of older checkpoints; 0.16 reads 0.19's through `read_common`.
# --------------------------------------------------------------------------------------------------


def _save_0_16(state: dict, path: str, strategy, async_save: bool):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.save(state, path, sharded_strategy=strategy, async_sharded_save=async_save)


def _save_0_17(state: dict, path: str, strategy, async_save: bool):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.save(state, path, sharded_strategy=strategy, async_sharded_save=async_save,
                                   async_strategy="mcore")


def _load_0_16(state: dict, path: str, strategy, read_common: Callable[[Path], dict]) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return read_common(Path(checkpoint_dir))

    return dist_checkpointing.load(state, path, sharded_strategy=strategy, common_strategy=SafeCommonLoadStrategy())


@contextlib.contextmanager
def _substituted(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def _loader_substituting(common_reader_name: str):
    def load(state: dict, path: str, strategy, read_common: Callable[[Path], dict]) -> dict:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import serialization

        def reader(checkpoint_dir):
            return read_common(Path(checkpoint_dir))

        with _substituted(serialization, common_reader_name, reader):
            return dist_checkpointing.load(state, path, sharded_strategy=strategy)

    return load


# --------------------------------------------------------------------------------------------------
# MoE router losses under `calculate_per_token_loss` (ours): `transformer/moe/router.py`
#   `attach_and_log_load_balancing_loss` and `apply_z_loss` scale the aux/z-loss gradients by a token count
#   while `finalize_model_grads` divides every gradient by the global token count.
#   0.16–0.18: the count is the rank's own sequence slice (`aux_loss * num_tokens`), so under sequence or
#              context parallelism the router losses pull TP×CP times too weakly: the coefficients we hand to
#              Megatron are multiplied by TP×CP.
#   0.19+:     Megatron multiplies by `tp_cp_group.size()` itself (`aux_loss * num_local_tokens *
#              self.tp_cp_group.size()`): the coefficients go in unchanged.
# --------------------------------------------------------------------------------------------------


def _router_loss_scale_0_16(tp: int, cp: int) -> int:
    return tp * cp


def _router_loss_scale_0_19(tp: int, cp: int) -> int:
    return 1


# --------------------------------------------------------------------------------------------------
# Megatron-FSDP (the same behaviour in every supported release, at moved lines; validation quotes them):
#   (where it builds its device as cuda:<current device> and creates its torch.cuda.Stream side streams,
#    where DistributedOptimizer.sharded_state_dict refuses Megatron-FSDP state outside fsdp_dtensor).
# --------------------------------------------------------------------------------------------------

_FSDP_SOURCES = {
    "0.16.1": ("megatron_fsdp.py:184, :361", "distrib_optimizer.py:1229"),
    "0.17.0": ("megatron_fsdp.py:196, :370", "distrib_optimizer.py:1241"),
    "0.18.0": ("megatron_fsdp.py:227, :404", "distrib_optimizer.py:1458"),
    "0.19.0": ("megatron_fsdp.py:234, :406", "distrib_optimizer.py:1514"),
}

# What the Megatron-FSDP rules quote (read in the 0.16.1, 0.17.0, 0.18.0 and 0.19.2 sources; a patch release
# quotes its series' lines, named): "mesh": the adapter's device mesh, `torch.arange(world)` rearranged as
# (dp_cp ep tp) — no pipeline dimension; "optim": the `optim` strategy reduces gradients in the last microbatch's
# backward hook and again in `finish_grad_sync` → `start_grad_sync`; "overlap": it forces overlap_param_gather /
# overlap_grad_reduce on. "ep_grad_norm": Megatron-FSDP × expert parallelism reports a wrong gradient norm
# (measured on 0.16.1; right on 0.19.2; 0.17/0.18 not measured). "dp1": Megatron-FSDP at DP×CP = 1 (its gradient
# buffer unsharded, "grad_buffer") gives wrong gradients (measured on 0.16.1; right on 0.19.2).
_FSDP_LIMITS = {
    "0.16.1": {"release": "0.16.1", "mesh": "mcore_fsdp_adapter.py:371", "optim": "megatron_fsdp.py:662, :1174",
               "overlap": "megatron_fsdp.py:276, :279", "ep_grad_norm": "wrong",
               "dp1": "wrong", "grad_buffer": "param_and_grad_buffer.py:2029"},
    "0.17.0": {"release": "0.17.0", "mesh": "mcore_fsdp_adapter.py:443", "optim": "megatron_fsdp.py:674, :1256",
               "overlap": "megatron_fsdp.py:287, :290", "ep_grad_norm": "not measured",
               "dp1": "not measured", "grad_buffer": "param_and_grad_buffer.py:2302"},
    "0.18.0": {"release": "0.18.0", "mesh": "mcore_fsdp_adapter.py:547", "optim": "megatron_fsdp.py:722, :1307",
               "overlap": "megatron_fsdp.py:321, :324", "ep_grad_norm": "not measured",
               "dp1": "not measured", "grad_buffer": "param_and_grad_buffer.py:2314"},
    "0.19.0": {"release": "0.19.2", "mesh": "mcore_fsdp_adapter.py:563", "optim": "megatron_fsdp.py:761, :1334",
               "overlap": "megatron_fsdp.py:330, :333", "ep_grad_norm": "right",
               "dp1": "right", "grad_buffer": "param_and_grad_buffer.py:2711"},
}


# --------------------------------------------------------------------------------------------------
# Batch-size ramp-up: `megatron.core.num_microbatches_calculator`
#   0.16:  `rampup_batch_size=[start, increment, ramp_samples]` builds RampupBatchsizeNumMicroBatchesCalculator:
#          the batch size is start + int(consumed / (ramp_samples / increments)) × increment, the target once
#          consumed > ramp_samples.
#   0.19:  that argument is ignored (deprecated) and the class is gone; a step schedule "SAMPLES:BATCH ..."
#          (StepBatchsizeNumMicroBatchesCalculator: the batch of the last threshold <= consumed) replaces it. The
#          ramp is handed over as that schedule (`ramp_schedule`): each batch size it takes, from the first
#          consumed-sample count at which 0.16's arithmetic gives it. Chosen by which class the release has.
# --------------------------------------------------------------------------------------------------


def _has_rampup_class() -> bool:
    from megatron.core import num_microbatches_calculator as calc

    return hasattr(calc, "RampupBatchsizeNumMicroBatchesCalculator")


def ramp_schedule(ramp: list[int], global_batch_size: int) -> list[tuple[int, int]]:
    """[(first consumed sample, batch size)] of a ramp, as 0.16's calculator computes it (float division and all)."""
    start, increment, samples = (int(v) for v in ramp)
    increments = (global_batch_size - start) // increment
    per_increment = samples / increments

    def reached(consumed: int) -> int:  # how many increments 0.16 adds at `consumed`
        return increments if consumed > samples else int(consumed / per_increment)

    out = [(0, start)]
    for k in range(1, increments + 1):
        lo, hi = out[-1][0], samples + 1  # the smallest count that reaches k increments (monotone: bisect)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if reached(mid) >= k else (mid + 1, hi)
        if lo == out[-1][0]:  # several increments at one count (ramp_samples < increments): the last wins
            out[-1] = (lo, start + k * increment)
        else:
            out.append((lo, start + k * increment))
    return out


def microbatch_calculator(ramp: list[int] | None, global_batch_size: int, micro_batch_size: int,
                          data_parallel_size: int):
    """A Megatron-Core microbatch calculator (`update(consumed, consistency_check)`, `get()`,
    `get_current_global_batch_size()`) of its own, outside the global one (validation, the planner)."""
    from megatron.core import num_microbatches_calculator as calc

    quiet = -1  # not rank 0: Megatron logs nothing
    if ramp is None:
        return calc.ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                      False, quiet)
    if _has_rampup_class():
        return calc.RampupBatchsizeNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                             False, quiet, *[int(v) for v in ramp])
    schedule = " ".join(f"{at}:{size}" for at, size in ramp_schedule(ramp, global_batch_size))
    return calc.StepBatchsizeNumMicroBatchesCalculator(micro_batch_size, data_parallel_size, False, quiet, schedule)


def init_microbatch_calculator(rank: int, ramp: list[int] | None, global_batch_size: int, micro_batch_size: int,
                               data_parallel_size: int) -> None:
    """Megatron-Core's global microbatch calculator of the run (the one its schedules read), with the ramp."""
    from megatron.core import num_microbatches_calculator as calc

    calc.unset_num_microbatches_calculator()
    if ramp is None or _has_rampup_class():
        calc.init_num_microbatches_calculator(rank, ramp, global_batch_size, micro_batch_size, data_parallel_size)
        return
    schedule = " ".join(f"{at}:{size}" for at, size in ramp_schedule(ramp, global_batch_size))
    calc.init_num_microbatches_calculator(rank, None, global_batch_size, micro_batch_size, data_parallel_size,
                                          step_batch_size_schedule=schedule)


# --------------------------------------------------------------------------------------------------
# The selection
# --------------------------------------------------------------------------------------------------

cp_batch: Callable[[dict], dict] = _pick({"0.16.1": _cp_batch_0_16, "0.18.0": _cp_batch_0_18})
save_sharded = _pick({"0.16.1": _save_0_16, "0.17.0": _save_0_17})
load_sharded = _pick({"0.16.1": _load_0_16, "0.17.0": _loader_substituting("load_common"),
                      "0.19.0": _loader_substituting("load_common_state_dict")})
megatron_fsdp_sources: tuple[str, str] = _pick(_FSDP_SOURCES)
megatron_fsdp_limits: dict[str, str] = _pick(_FSDP_LIMITS)
moe_router_loss_scale: Callable[[int, int], int] = _pick({"0.16.1": _router_loss_scale_0_16,
                                                          "0.19.0": _router_loss_scale_0_19})
# A Multi-Token Prediction depth's transformer layer as `named_parameters()` names it (the planner's census): 0.16
# `mtp.layers.{d}.transformer_layer`, 0.17+ `mtp.layers.{d}.mtp_model_layer` (its `sharded_state_dict` maps the name
# back to `transformer_layer.`, so checkpoints and the HF bridge keep the 0.16 keys).
mtp_layer_name: str = _pick({"0.16.1": "transformer_layer", "0.17.0": "mtp_model_layer"})
