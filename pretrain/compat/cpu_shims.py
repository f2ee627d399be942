"""Run Megatron-Core on CPU (gloo): the CUDA assumptions it makes, worked around in one place.

`apply_cpu_shims()` is called at start-up (`pretrain.compat.apply`) only when `torch.cuda.is_available()`
is False. It edits nothing on disk; every change is a run-time substitution listed in `SHIMS` with the
megatron-core releases that need it (facts measured in shared/docs/megatron_on_cpu.md):

- Megatron-Core's torch.compile'd fusions (`megatron.core.jit.jit_fuser`) are eager, by its own `disable_jit_fuser`
  made to hold from the first import of megatron.core: decorating them set up dynamo in every process (about 4 s of
  start-up); on CPU the fusions are off unless forced, and forced they compute the same in eager mode. 0.16.1+.
- megatron.core's optional imports of `wandb` (inference context, timers) and `transformers` (HF and chat-template
  tokenizers) are deferred to first use (`pretrain.compat.deferred_imports`): about 7.5 s of every CPU process's
  start-up, spent on packages a SentencePiece run without W&B never calls. 0.16.1+.
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
- Torch factory functions drop `pin_memory=True` (page-locked memory needs CUDA: "Cannot access accelerator
  device when none is available"): context parallelism's RoPE slice, `rope_utils.get_pos_emb_on_this_cp_rank`
  (`models/common/embeddings/rope_utils.py:62-64` in 0.16.1 and 0.19.2), builds its chunk index with it. 0.16.1+.
  `switched_off("pin_memory_without_cuda")` undoes it for a test that shows the failure.
- The gradient norm (and so the clipping coefficient) sums squares in fp64: without apex/TE Megatron-Core's
  `local_multi_tensor_l2_norm` (`utils.py:1200-1208` in 0.16.1, `:1325-1333` in 0.19.2, used by
  `optimizer/clip_grads.py`) takes `torch.norm` of each fp32 gradient, whose CPU reduction accumulates in fp32: its
  error grows with the tensor (measured 3.5e-6 relative at 524k elements, 3.2e-5 at 2M, ~3e-4 on a 4-million-value
  output layer) and depends on how the tensor is split (TP, distributed-optimizer and FSDP shards round
  differently), so the same gradients reported norms up to 5e-5 apart across layouts. Each tensor's norm
  accumulates in float64 here; the result stays fp32. 0.16.1+. `switched_off("fp64_grad_norm")` undoes it.
- Megatron-FSDP (`pretrain.compat.fsdp_cpu`, scoped to the FSDP modules): its CUDA device and its CUDA device
  meshes are the CPU's. 0.16.1+.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from pretrain.compat.patching import Patch, Patches

_PATCHES = Patches("CPU shim(s)", lambda: [s.name for s in SHIMS])

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


def _unpinned_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return wrapper


def _pin_memory() -> list:
    return [(torch, name, _unpinned_factory(getattr(torch, name))) for name in _FACTORIES]


def switched_off(*names: str) -> contextlib.AbstractContextManager[None]:
    """Within the block, the named shims are undone (to show what they work around), then re-applied."""
    return _PATCHES.switched_off(names, apply_cpu_shims)


def _fp64_grad_norm() -> list:
    from megatron.core.optimizer import clip_grads

    original = clip_grads.l2_norm_impl
    if getattr(original, "__module__", "") != "megatron.core.utils":  # apex / TE kernels: not ours to change
        return []

    @functools.wraps(original)
    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        total = torch.zeros((), dtype=torch.float64)
        for tensors in tensor_lists:
            for t in tensors:
                total += torch.linalg.vector_norm(t, dtype=torch.float64).cpu() ** 2
        return total.sqrt().float().reshape(1), None

    return [(clip_grads, "l2_norm_impl", l2_norm)]


def _device_and_sync() -> list:
    return [(torch.cuda, "current_device", lambda: "cpu"), (torch.cuda, "synchronize", lambda *a, **k: None)]


@contextlib.contextmanager
def _no_torch_compile():
    """torch.compile as an identity decorator within the block."""
    original = torch.compile

    def _decorate(model=None, **_kwargs):
        return model if model is not None else (lambda fn: fn)

    torch.compile = _decorate
    try:
        yield
    finally:
        torch.compile = original


def _eager_fusions() -> list:
    """Megatron-Core's `jit_fuser` (torch.compile) fusions run eagerly, as its own `megatron.core.jit.disable_jit_fuser`
    makes them, from the first import of megatron.core on: each decorated function otherwise sets up dynamo at import
    (about 4 s of every CPU process's start-up), and on CPU the fusions are off unless forced (same math either way).
    torch.compile itself is put back once megatron.core is imported."""
    from pretrain.compat.deferred_imports import first_import

    first_import(_no_torch_compile())  # a no-op if megatron.core is imported already
    from megatron.core import jit

    jit.disable_jit_fuser()
    return []


def _deferred_imports() -> list:
    """megatron.core first imported with `wandb` and `transformers` deferred to first use (`deferred_imports`)."""
    from pretrain.compat.deferred_imports import first_import

    first_import(_no_torch_compile())
    return []


def _factories() -> list:
    return [(torch, name, _cpu_factory(getattr(torch, name))) for name in _FACTORIES] + [
        (torch.Tensor, "cuda", lambda self, *a, **k: self)]


def _type_strings() -> list:
    original_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        if dtype is None:
            return original_type(self, **kwargs)
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return original_type(self, dtype, non_blocking, **kwargs)

    return [(torch.Tensor, "type", _type)]


def _rng() -> list:
    from megatron.core.tensor_parallel import random as mrandom

    # On CPU the tracker's "GPU" generator is the CPU one; its "CPU state changed" warning is noise.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)
    return [
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed))),
        (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
    ]


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


def _streams_and_events() -> list:
    return [(torch.cuda, "Stream", _HostStream), (torch.cuda, "Event", _HostEvent),
            (torch.cuda, "current_stream", lambda *a, **k: _CURRENT_STREAM),
            (torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())]


def _moe_dispatch() -> list:
    import torch.distributed as dist
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original_all_reduce = dist.all_reduce

    @functools.wraps(original_all_reduce)
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.AVG and dist.get_backend(group) == "gloo" and not async_op:
            work = original_all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
            tensor.div_(dist.get_world_size(group))
            return work
        return original_all_reduce(tensor, op=op, group=group, async_op=async_op)


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

    return [(moe_utils, "maybe_move_tensor_to_cpu", _host_copy),
            (token_dispatcher, "maybe_move_tensor_to_cpu", _host_copy),
            (dist, "all_reduce", all_reduce), (dist, "all_gather", all_gather)]


SHIMS = (
    Patch("current_device_and_synchronize", "0.16.1", None, _device_and_sync),
    Patch("deferred_optional_imports", "0.16.1", None, _deferred_imports),  # before anything imports megatron.core
    Patch("eager_jit_fusions", "0.16.1", None, _eager_fusions),
    Patch("cuda_factories", "0.16.1", None, _factories),
    Patch("cuda_type_strings", "0.16.1", None, _type_strings),
    Patch("cuda_rng", "0.16.1", None, _rng),
    Patch("cuda_streams_and_events", "0.16.1", None, _streams_and_events),
    Patch("moe_dispatch_on_gloo", "0.16.1", None, _moe_dispatch),
    Patch("pin_memory_without_cuda", "0.16.1", None, _pin_memory),
    Patch("fp64_grad_norm", "0.16.1", None, _fp64_grad_norm),
)


def apply_cpu_shims() -> list[str]:
    """Patch the CUDA assumptions of the installed megatron-core so it trains on CPU. Idempotent.

    Returns the names of the shims in effect.
    """

    from pretrain.compat.fsdp_cpu import apply_fsdp_shims  # Megatron-FSDP's own, scoped to its modules

    if torch.cuda.is_available():
        raise RuntimeError("CPU shims must not be applied on a machine with CUDA")
    return _PATCHES.apply_needed(SHIMS) + apply_fsdp_shims()
