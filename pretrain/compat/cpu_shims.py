"""Run Megatron-Core on CPU (gloo): the CUDA assumptions it makes, worked around in one place.

`apply_cpu_shims()` is called at start-up (`pretrain.compat.apply`) only when `torch.cuda.is_available()`
is False. It edits nothing on disk; every change is a run-time substitution listed in `SHIMS` with the
megatron-core releases that need it (facts measured in shared/docs/megatron_on_cpu.md):

- `torch.cuda.current_device()` returns "cpu" (RoPE, global memory buffer, SP mappings). 0.16.1+.
- Torch factory functions map a CUDA `device=` argument to CPU; `Tensor.cuda()` is the identity
  (hard-coded `device="cuda"` in schedules, optimizer and grad clipping). 0.16.1+.
- `Tensor.type()` reports `torch.cuda.*Tensor` for CPU floating tensors (optimizer type checks). 0.16.1+.
- The CUDA RNG used by Megatron's RNG tracker and activation recompute is the CPU generator. 0.16.1+.
- `torch.cuda.synchronize()` is a no-op. 0.16.1+.
- CUDA streams and events are synchronous no-op stand-ins: the all-to-all MoE dispatcher's device-to-host
  stream and events (0.16.1+), and `torch.cuda.current_stream()`, which 0.19 also calls on every gradient
  sync (`ParamAndGradBuffer.start_grad_sync`, for CUDA-graph events). 0.16.1+.
- MoE dispatch on gloo (0.16.1+): the all-to-all dispatcher's split sizes, which it turns into host numpy
  arrays only when they are CUDA tensors (`maybe_move_tensor_to_cpu(as_numpy=True)`), become numpy arrays
  for CPU tensors too (gloo's `all_to_all_single` takes a sequence of ints, not a tensor);
  `all_reduce(op=AVG)` — NCCL-only, used by the MoE aux-loss tracker — is a SUM divided by the group size on
  gloo; and `all_gather` into tensors of different lengths (expert tensor parallelism gathers each rank's
  routed tokens), which gloo refuses, pads every piece to the longest.
- The gradient norm without apex (`optimizer/clip_grads.py`'s `local_multi_tensor_l2_norm`, `utils.py:1200` /
  `:1325`) is `torch.norm` of each fp32 gradient, and torch's CPU reduction accumulates in fp32: its error grows
  with the tensor (measured 3.5e-6 relative at 524k elements, 3.2e-5 at 2M) and depends on how the tensor is
  split, so the same gradients reported norms 1e-5 apart at TP2 and on one rank (float64 sums of the gradients:
  within 6e-9). Each tensor's norm accumulates in float64 here; the result stays fp32. 0.16.1+.
- Megatron-FSDP (`pretrain.compat.fsdp_cpu`, scoped to the FSDP modules): its CUDA device and its CUDA device
  meshes are the CPU's. 0.16.1+.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

_APPLIED: list[str] = []

_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "linspace",
)  # fmt: skip

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


def _device_and_sync() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None


def _factories() -> None:
    for name in _FACTORIES:
        setattr(torch, name, _cpu_factory(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self


def _type_strings() -> None:
    original_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        if dtype is None:
            return original_type(self, **kwargs)
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type


def _rng() -> None:
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # On CPU the tracker's "GPU" generator is the CPU one; its "CPU state changed" warning is noise.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)


# --------------------------------------------------------------------------------------------------
# MoE (megatron-core 0.16.1 `transformer/moe/token_dispatcher.py`, `moe_utils.py`)
# --------------------------------------------------------------------------------------------------


class _HostEvent:
    """Stand-in for `torch.cuda.Event`: CPU work is synchronous, so every event has already happened."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """Stand-in for `torch.cuda.Stream` (the all-to-all dispatcher's device-to-host copy stream)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return event or _HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _HostStream()


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """`maybe_move_tensor_to_cpu` for tensors that are already on the host."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _streams_and_events() -> None:
    torch.cuda.Stream = _HostStream
    torch.cuda.Event = _HostEvent
    torch.cuda.current_stream = lambda *a, **k: _CURRENT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _moe_dispatch() -> None:
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _host_copy
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy

    original_all_reduce = dist.all_reduce

    @functools.wraps(original_all_reduce)
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.AVG and dist.get_backend(group) == "gloo" and not async_op:
            work = original_all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
            tensor.div_(dist.get_world_size(group))
            return work
        return original_all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce

    original_all_gather = dist.all_gather

    @functools.wraps(original_all_gather)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        rows = [t.shape[0] for t in tensor_list]
        if len(set(rows)) == 1 or async_op or dist.get_backend(group) != "gloo":
            return original_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(rows)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        pieces = [torch.empty_like(padded) for _ in tensor_list]
        work = original_all_gather(pieces, padded, group=group)
        for out, piece, n in zip(tensor_list, pieces, rows):
            out.copy_(piece[:n])
        return work

    dist.all_gather = all_gather


def _fp64_grad_norm() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    if clip_grads.l2_norm_impl is not local_multi_tensor_l2_norm:  # apex's kernel: left alone
        return

    @functools.wraps(local_multi_tensor_l2_norm)
    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        squares = [torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for ts in tensor_lists for t in ts]
        total = torch.stack(squares).sum().sqrt() if squares else torch.zeros((), dtype=torch.float64)
        return total.to(torch.float32).reshape(1), None

    clip_grads.l2_norm_impl = l2_norm


@dataclass(frozen=True)
class Shim:
    name: str
    since: str  # first megatron-core release that needs it (0.16.1: every supported release)
    apply: Callable[[], None]


SHIMS = (
    Shim("current_device_and_synchronize", "0.16.1", _device_and_sync),
    Shim("cuda_factories", "0.16.1", _factories),
    Shim("cuda_type_strings", "0.16.1", _type_strings),
    Shim("cuda_rng", "0.16.1", _rng),
    Shim("cuda_streams_and_events", "0.16.1", _streams_and_events),
    Shim("moe_dispatch_on_gloo", "0.16.1", _moe_dispatch),
    Shim("grad_norm_fp64_accumulation", "0.16.1", _fp64_grad_norm),
)


def apply_cpu_shims() -> list[str]:
    """Patch the CUDA assumptions of the installed megatron-core so it trains on CPU. Idempotent.

    Returns the names of the shims in effect.
    """
    from packaging.version import Version

    from pretrain.compat.fsdp_cpu import apply_fsdp_shims  # Megatron-FSDP's own, scoped to its modules
    from pretrain.compat.mcore import MCORE

    if not _APPLIED:
        if torch.cuda.is_available():
            raise RuntimeError("CPU shims must not be applied on a machine with CUDA")
        for shim in SHIMS:
            if MCORE >= Version(shim.since):
                shim.apply()
                _APPLIED.append(shim.name)
    return _APPLIED + apply_fsdp_shims()
