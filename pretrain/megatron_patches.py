"""Narrow, version-pinned run-time fixes to Megatron-Core 0.16.1 checkpoint loading.

Nothing on disk is edited; `apply_megatron_patches()` wraps a few methods, once per process.

Distributed optimizer over torch's Adam/AdamW (what Megatron-Core uses when neither Transformer Engine nor
apex is installed: CPU, and GPUs without them) — three problems of `megatron/core/optimizer/
distrib_optimizer.py`, measured in shared/docs/megatron_on_cpu.md:

1. `DistributedOptimizer.state_dict()` (line 642) asserts that the inner state holds exactly one `step`;
   a fresh optimizer (every load, before the first step) has none, so loading fails.
   Fix: with no per-parameter state yet, the step is 0.
2. `_set_main_param_and_optimizer_states()` (line 940) copies every key of the live state, `step`
   included, from the loaded shard, which (`fully_reshardable`) has no `step`: `KeyError: 'step'`.
   Fix: the live `step` (already set from the checkpoint's param groups) is passed through unchanged.
3. `load_state_dict()` (line 825) gives every parameter the same `step` tensor; torch's Adam increments
   it once per parameter, so after a load the bias correction runs ahead (a TP2→TP1 load moved the
   next loss by 6.4e-3). Fix: every parameter gets its own copy after the load.

Safe loading (any optimizer): torch's `DefaultLoadPlanner.load_bytes`, which Megatron's `MCoreLoadPlanner`
inherits, unpickles the byte items of a `torch_dist` checkpoint (`ShardedObject`s such as the RNG state and
`_extra_state`) with `weights_only=False`. Fix: `weights_only=True` (Megatron-Core registers the
few non-tensor classes it writes as torch safe globals at import).

MoE without Transformer Engine (`apply_moe_fixes`, run by the runtime before any model is built):
`transformer/moe/moe_utils.py` defines `te_general_gemm` and the `fused_*` MoE kernels only when TE imports,
but the router's gating GEMM tests `te_general_gemm is not None` unconditionally: `NameError` in the first
forward on every machine without TE. Fix: the missing names are None (what the code expects for "absent").
"""

from __future__ import annotations

import io

import torch

MEGATRON_CORE_VERSION = "0.16.1"

_APPLIED: set[str] = set()


class UnsafeCheckpointObject(RuntimeError):
    """A pickled object in a checkpoint that the weights-only unpickler refuses."""


def informative_line(exc: BaseException) -> str:
    """The line of an exception that says what went wrong (torch's weights-only errors bury it)."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.CheckpointException
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return informative_line(inner)
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    # The weights-only unpickler's actual reason, else the first line; its first sentence when long.
    line = next((ln for ln in lines if "Unsupported" in ln or "not allowed" in ln), lines[0])
    return line.split(". ")[0] if len(line) > 120 else line


def megatron_core_version() -> str:
    import megatron.core

    return megatron.core.__version__


def needs_distrib_optimizer_fixes() -> bool:
    """True when Megatron's distributed optimizer wraps torch's Adam/AdamW (no TE / apex)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _check_version() -> None:
    found = megatron_core_version()
    if found != MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"pretrain/megatron_patches.py targets megatron-core {MEGATRON_CORE_VERSION}, found {found}: "
            "re-check the distributed-optimizer and load_bytes fixes against this version, then update the pin"
        )


def _fresh_state_dict(self) -> dict:
    """`DistributedOptimizer.state_dict()` for an inner optimizer that has not stepped yet (step 0)."""
    inner = self.optimizer.state_dict()
    groups = []
    for group in inner["param_groups"]:
        group = {k: v for k, v in group.items() if k != "params"}
        group["step"] = 0
        groups.append(group)
    state_dict = {"optimizer": {"param_groups": groups}}
    if self.grad_scaler:
        state_dict["grad_scaler"] = self.grad_scaler.state_dict()
    return state_dict


def _patch_distrib_optimizer() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_state_dict = DistributedOptimizer.state_dict
    original_set_states = DistributedOptimizer._set_main_param_and_optimizer_states
    original_load_state_dict = DistributedOptimizer.load_state_dict

    def state_dict(self):
        if self.ddp_config.use_megatron_fsdp:
            return original_state_dict(self)
        if not any("step" in s for s in self.optimizer.state.values()):  # problem 1
            return _fresh_state_dict(self)
        return original_state_dict(self)

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:  # problem 2: keep the step loaded from the param groups
                tensors = {**tensors, "step": step}
        return original_set_states(self, model_param, tensors)

    def load_state_dict(self, state_dict):
        original_load_state_dict(self, state_dict)
        seen: set[int] = set()
        for state in self.optimizer.state.values():  # problem 3: one step tensor per parameter
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.detach().clone()
                seen.add(id(step))

    DistributedOptimizer.state_dict = state_dict
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict


def _patch_load_bytes() -> None:
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner
    from torch.distributed.checkpoint.planner import ReadItem

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # UnpicklingError and friends: never fall back to full unpickling
            raise UnsafeCheckpointObject(f"checkpoint object '{fqn}' refused by the weights-only loader: "
                                         f"{informative_line(exc)}") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj

    MCoreLoadPlanner.load_bytes = load_bytes


def _patch_checkpoint_without_output() -> None:
    """Selective recompute of norms without Transformer Engine (`model.recompute_modules: [layernorm]`).

    `tensor_parallel/random.py`: `CheckpointWithoutOutput.__init__(fp8=False)` sets `self.fp8 = fp8 is not None`,
    True for its default, so `CheckpointWithoutOutputFunction.forward` (line 589) reaches the TE-only
    `FP8GlobalStateManager`: `NameError` wherever TE is not installed (CPU, GPUs without TE). With TE installed
    Megatron relies on that True (FP8 bookkeeping of recomputed norms), so only without TE is fp8 turned off.
    """
    from megatron.core.tensor_parallel import random as mrandom

    if mrandom.HAVE_TE:
        return
    original = mrandom.CheckpointWithoutOutput.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.fp8 = False

    mrandom.CheckpointWithoutOutput.__init__ = __init__


def apply_megatron_patches() -> None:
    """Apply the fixes this machine needs (idempotent). Raises on another megatron-core version."""
    if "checkpoint_without_output" not in _APPLIED:
        _patch_checkpoint_without_output()
        _APPLIED.add("checkpoint_without_output")
    if "load_bytes" not in _APPLIED:
        _check_version()
        _patch_load_bytes()
        _APPLIED.add("load_bytes")
    if "distrib_optimizer" not in _APPLIED and needs_distrib_optimizer_fixes():
        _check_version()
        _patch_distrib_optimizer()
        _APPLIED.add("distrib_optimizer")


_MOE_TE_NAMES = (
    "te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
    "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function", "fused_unpermute",
)  # fmt: skip


def apply_moe_fixes() -> None:
    """Define the TE-only names of Megatron-Core's MoE utilities as None when TE is absent (idempotent)."""
    if "moe_without_te" in _APPLIED:
        return
    from megatron.core.transformer.moe import moe_utils

    for name in _MOE_TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    _APPLIED.add("moe_without_te")


def applied_patches() -> frozenset[str]:
    return frozenset(_APPLIED)
