"""Megatron-FSDP on CPU (gloo): its CUDA assumptions, worked around inside the FSDP modules only.

Applied by `cpu_shims.apply_cpu_shims()` (no CUDA) after the general shims; facts in
shared/docs/cp_and_fsdp_on_cpu.md. Line numbers are megatron-core 0.16.1 / 0.19.2.

- `fsdp_cpu_device` (0.16.1+): `MegatronFSDP.__init__` builds `torch.device(f"cuda:{current_device()}")` and
  compares the given device with it even when one is passed (`megatron_fsdp.py:182,184` / `:232,234`; the
  adapter's default at `mcore_fsdp_adapter.py:91` / `:156`). With the general shim `current_device()` is "cpu",
  so the string is "cuda:cpu": `RuntimeError: Invalid device string`. Inside those two modules only,
  `torch.device` maps a CUDA device to the CPU (isinstance checks still see `torch.device`).
- `fsdp_cpu_device_mesh` (0.16.1+): the adapter builds its meshes with `DeviceMesh.from_group(...,
  device_type="cuda")` (`mcore_fsdp_adapter.py:251,265,276` / `:409,420,438,449`); `DTensor.from_local` then
  moves every local shard to CUDA (`param_and_grad_buffer.py:4145` / `:5149`). Inside the adapter,
  `from_group` gets `device_type="cpu"`.

Each shim is a list of (owner, attribute, replacement) that `disabled()` undoes, so the fix tests can show the
failure it prevents (`tests/pretrain/test_megatron_fixes.py`).
"""

from __future__ import annotations

import contextlib
import types

import torch

from pretrain.compat.patching import Patch, Patches

_PATCHES = Patches("FSDP shim(s)", lambda: [s.name for s in FSDP_SHIMS])
_APPLIED, _DISABLED = _PATCHES.applied, _PATCHES.disabled


def _cpu_if_cuda(args: tuple) -> tuple:
    first = args[0] if args else None
    if (isinstance(first, str) and first.startswith("cuda")) or (
            isinstance(first, torch.device) and first.type == "cuda"):
        return ("cpu",)
    return args


class _DeviceType(type):
    """`torch.device` as seen by the FSDP modules: CUDA devices are the CPU; isinstance is unchanged."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.device)

    def __call__(cls, *args, **kwargs):
        return torch.device(*_cpu_if_cuda(args), **kwargs)


class _CPUDevice(metaclass=_DeviceType):
    pass


def _torch_with_cpu_device() -> types.ModuleType:
    """A stand-in for the `torch` module name inside an FSDP module: everything is torch's, but `device`."""
    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # looked up live: later shims of torch are seen
    proxy.device = _CPUDevice
    return proxy


def _fsdp_modules() -> list[types.ModuleType]:
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp

    return [megatron_fsdp, mcore_fsdp_adapter]


def _device() -> list:
    proxy = _torch_with_cpu_device()
    return [(module, "torch", proxy) for module in _fsdp_modules()]


class _CPUDeviceMesh:
    """`DeviceMesh` as seen by the adapter: `from_group(device_type="cuda")` builds a CPU mesh."""

    def __init__(self, *args, **kwargs):
        raise TypeError("construct DeviceMesh through from_group")

    @staticmethod
    def from_group(*args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh

        if kwargs.get("device_type") == "cuda":
            kwargs["device_type"] = "cpu"
        elif len(args) > 1 and args[1] == "cuda":
            args = (args[0], "cpu", *args[2:])
        return DeviceMesh.from_group(*args, **kwargs)


def _device_mesh() -> list:
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    return [(mcore_fsdp_adapter, "DeviceMesh", _CPUDeviceMesh)]


FSDP_SHIMS = (
    Patch("fsdp_cpu_device", "0.16.1", None, _device),
    Patch("fsdp_cpu_device_mesh", "0.16.1", None, _device_mesh),
)


def apply_fsdp_shims() -> list[str]:
    """Apply the FSDP CPU shims the installed release needs (idempotent); returns those in effect."""
    return _PATCHES.apply_needed(FSDP_SHIMS)


def disabled(*names: str) -> contextlib.AbstractContextManager[None]:
    """Within the block, the named FSDP shims are undone (to show what they work around)."""
    return _PATCHES.switched_off(names, apply_fsdp_shims)
