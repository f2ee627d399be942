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
- `torch.cuda.current_stream()` is a stream whose waits are no-ops: 0.19 calls it on every gradient
  sync (`ParamAndGradBuffer.start_grad_sync`, for CUDA-graph events). 0.19.0+.
"""

from __future__ import annotations

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


class _CpuStream:
    """What Megatron asks of the current CUDA stream, on CPU: every wait is already satisfied."""

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _current_stream() -> None:
    stream = _CpuStream()
    torch.cuda.current_stream = lambda *a, **k: stream


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
    Shim("current_stream", "0.19.0", _current_stream),
)


def apply_cpu_shims() -> list[str]:
    """Patch the CUDA assumptions of the installed megatron-core so it trains on CPU. Idempotent.

    Returns the names of the shims in effect.
    """
    from packaging.version import Version

    from pretrain.compat.mcore import MCORE

    if _APPLIED:
        return list(_APPLIED)
    if torch.cuda.is_available():
        raise RuntimeError("CPU shims must not be applied on a machine with CUDA")
    for shim in SHIMS:
        if MCORE >= Version(shim.since):
            shim.apply()
            _APPLIED.append(shim.name)
    return list(_APPLIED)
