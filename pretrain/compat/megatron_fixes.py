"""Narrow run-time fixes to Megatron-Core bugs, each naming the releases it is needed on.

Nothing on disk is edited; `apply_megatron_fixes()` (called at start-up by `pretrain.compat.apply`) wraps a
few methods, once per process, for the fixes whose `since`/`fixed_in` range holds the installed release.
`tests/pretrain/test_megatron_fixes.py` switches each fix off in turn and shows that the bug is present
exactly on the releases the fix names (run on 0.16.1 and 0.19.2 in CI).

Distributed optimizer over torch's Adam/AdamW (what Megatron-Core uses when neither Transformer Engine nor
apex is installed: CPU, and GPUs without them) — three problems of `megatron/core/optimizer/
distrib_optimizer.py` (line numbers of 0.16.1 / 0.19.2), measured in shared/docs/megatron_on_cpu.md:

1. `distopt_fresh_state_dict` — `DistributedOptimizer.state_dict()` (642 / 839) asserts that the inner state
   holds exactly one `step`; a fresh optimizer (every load, before the first step) has none, so loading
   fails. Fix: with no per-parameter state yet, the step is 0.
2. `distopt_load_missing_step` — `_set_main_param_and_optimizer_states()` (940 / 1225) copies every key of
   the live state, `step` included, from the loaded shard, which (`fully_reshardable`) has no `step`:
   `KeyError: 'step'`. Fix: the live `step` (already set from the checkpoint's param groups) is kept.
3. `distopt_shared_step` — `load_state_dict()` (825 / 1032) gives every parameter the same `step` tensor;
   torch's Adam increments it once per parameter, so after a load the bias correction runs ahead (a
   TP2→TP1 load moved the next loss by 6.4e-3). Fix: every parameter gets its own copy after the load.

Safe loading (any optimizer): 4. `load_bytes_weights_only` — torch's `DefaultLoadPlanner.load_bytes`, which
Megatron's `MCoreLoadPlanner` inherits, unpickles the byte items of a `torch_dist` checkpoint
(`ShardedObject`s such as the RNG state and `_extra_state`) with `weights_only=False`, and so does DCP itself for
the `fsdp_dtensor` checkpoints of Megatron-FSDP runs (`torch/distributed/checkpoint/default_planner.py:387`, the
optimizer's param-group metadata and the RNG states). Fix: `weights_only=True` on both planners (Megatron-Core
registers the few non-tensor classes it writes as torch safe globals).

Without Transformer Engine (CPU, GPUs without TE):
5. `recompute_norms_without_te` — `tensor_parallel/random.py`: `CheckpointWithoutOutput.__init__(fp8=False)` sets
   `self.fp8 = fp8 is not None`, True for its default, so its forward reaches the TE-only
   `FP8GlobalStateManager`: `NameError` on `model.recompute_modules: [layernorm]`. Fix: `fp8` off without TE
   (with TE Megatron relies on that True for the FP8 bookkeeping of recomputed norms).
6. `moe_router_without_te` — `transformer/moe/moe_utils.py` defines `te_general_gemm` and the `fused_*` MoE
   kernels only when TE imports, but the router's gating GEMM tests `te_general_gemm is not None`
   unconditionally: `NameError` in the first MoE forward. Fix: the missing names are None ("absent").
   Fixed upstream in 0.17.0 (`moe_utils.py` sets them to None without TE; checked in the 0.17.0, 0.18.0,
   0.19.0 sources and shown on 0.19.2 by the test).
7. `fsdp_tp_without_te` — Megatron-FSDP with tensor parallelism: `FullyShardedDataParallel.
   _fix_tensor_parallel_attributes` (`distributed/fsdp/mcore_fsdp_adapter.py:184`; 0.17.0 :214) tests
   `isinstance(module, (TELinear,))`, and without TE `TELinear` is not a class (a stand-in built on TE's mock
   module): `TypeError: isinstance() arg 2 must be a type` at wrap time for parallel.tensor > 1. Fix: without TE
   the adapter sees a class no module is an instance of (there are no TE modules). Fixed upstream in 0.18.0 (it
   compares class names; checked in the 0.18.0 source and shown on 0.19.2 by the test).

Multi-Latent Attention on the local spec (CPU, GPUs without TE):
8. `mla_local_core_attention` — `MultiLatentAttention.__init__` (`transformer/multi_latent_attention.py`) builds its
   core attention with `k_channels` / `v_channels` (query/key and value head widths differ: 192 and 128 for
   DeepSeek-V3), which only TE's attention accepts; the local spec's `DotProductAttention.__init__` raises
   `TypeError: unexpected keyword argument 'k_channels'`. Fix: the local attention takes both, and its output width
   is heads × `v_channels` (its matmuls already follow the tensors' own head widths; MLA passes its softmax scale).
   Present in 0.16.1 and 0.19.2 (`dot_product_attention.py`, same signature).
9. `mla_without_te` — `multi_latent_attention.py` sets `HAVE_TE = True` when `megatron.core.extensions.
   transformer_engine` imports, which it does without TE (its classes are then MagicMock placeholders), so
   `MLASelfAttention.__init__` calls `isinstance(self.linear_proj, TELinear)` with a placeholder: `TypeError`. Fix:
   the module's `HAVE_TE` is False without TE. Fixed upstream in 0.17.0 (it imports the extension's own `HAVE_TE`;
   checked in the 0.17.0, 0.18.0 and 0.19.2 sources).
10. `mla_q_norm_without_q_lora` — from 0.19.0 `MLASelfAttention` resolves its norms with `QKNormConfigResolver`
   (`transformer/mla_qk_norm_config.py`), which, with `qk_layernorm` and no q LoRA (`q_lora_rank=None`:
   DeepSeek-V2-Lite, Moonlight), puts a norm on the query projection's input: a fused norm+linear with TE (a norm
   that neither 0.16–0.18 nor the HF model has: `q_proj` reads the input norm's output) and, without TE, a
   `RuntimeError` ("qk_layernorm requires TransformerEngine ..."). Fix: without q LoRA the query projection is the
   spec's plain linear and only the KV latent norm is resolved (as 0.16.1–0.18.0 build it). Absent from the
   0.17.0 and 0.18.0 sources; present in 0.19.0 and 0.19.2.
"""

from __future__ import annotations

import contextlib
import io

import torch

from pretrain.compat.patching import Patch, Patches

_PATCHES = Patches("Megatron fix(es)", lambda: [fix.name for fix in FIXES])
_APPLIED, _DISABLED = _PATCHES.applied, _PATCHES.disabled  # fix name -> [(owner, attribute, original)]; names off


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


def torch_adam_inside_distributed_optimizer() -> bool:
    """True when Megatron's distributed optimizer wraps torch's Adam/AdamW (no TE / apex)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


# --------------------------------------------------------------------------------------------------
# The fixes: each returns the replacements [(owner, attribute, new value)]
# --------------------------------------------------------------------------------------------------


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


def _distopt_fresh_state_dict() -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.state_dict

    def state_dict(self):
        if self.ddp_config.use_megatron_fsdp:
            return original(self)
        if not any("step" in s for s in self.optimizer.state.values()):
            return _fresh_state_dict(self)
        return original(self)

    return [(DistributedOptimizer, "state_dict", state_dict)]


def _distopt_load_missing_step() -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:  # keep the step loaded from the param groups
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    return [(DistributedOptimizer, "_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states)]


def _distopt_shared_step() -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        original(self, state_dict)
        seen: set[int] = set()
        for state in self.optimizer.state.values():  # one step tensor per parameter
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.detach().clone()
                seen.add(id(step))

    return [(DistributedOptimizer, "load_state_dict", load_state_dict)]


def _load_bytes_weights_only() -> list:
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

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    # DCP's own planner too: the fsdp_dtensor checkpoints (pretrain/checkpoint/fsdp_format.py) load through it.
    return [(MCoreLoadPlanner, "load_bytes", load_bytes), (DefaultLoadPlanner, "load_bytes", load_bytes)]


def _recompute_norms_without_te() -> list:
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    original = CheckpointWithoutOutput.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.fp8 = False

    return [(CheckpointWithoutOutput, "__init__", __init__)]


_MOE_TE_NAMES = (
    "te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
    "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function", "fused_unpermute",
)  # fmt: skip


def _moe_router_without_te() -> list:
    from megatron.core.transformer.moe import moe_utils

    return [(moe_utils, name, None) for name in _MOE_TE_NAMES if not hasattr(moe_utils, name)]


class _NoTELinear:
    """What `TELinear` is without Transformer Engine: a class no module is an instance of."""


def _fsdp_tp_without_te() -> list:
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    return [(mcore_fsdp_adapter, "TELinear", _NoTELinear)]


def _without_te() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    return not mrandom.HAVE_TE


def _mla_local_core_attention() -> list:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original = DotProductAttention.__init__

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        original(self, *args, **kwargs)
        if v_channels is not None:  # [sq, b, heads/TP × v_channels] out
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return [(DotProductAttention, "__init__", __init__)]


def _mla_without_te() -> list:
    from megatron.core.transformer import multi_latent_attention

    placeholder = not isinstance(multi_latent_attention.TELinear, type)  # None or a MagicMock without TE
    return [(multi_latent_attention, "HAVE_TE", False)] if placeholder else []


def _mla_q_norm_without_q_lora() -> list:
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    original = MLASelfAttention._resolve_qk_norm_config

    def _resolve_qk_norm_config(self, submodules):
        if self.config.q_lora_rank is not None or not self.config.qk_layernorm:
            return original(self, submodules)
        r = QKNormConfigResolver(self.config, submodules)
        kv_norm = submodules.kv_layernorm or IdentityOp
        if r._is_trivial(kv_norm):  # the norm fused into the KV up-projection (TE)
            kv_up = r._mla_fused_linear_or_default(submodules.linear_kv_up_proj, "linear_kv_up_proj")
        else:
            kv_up = r._non_fused_or_default(submodules.linear_kv_up_proj, "linear_kv_up_proj")
        q_proj = submodules.linear_q_proj or r.linear_impl
        return r._result(linear_q_proj=q_proj, linear_q_up_proj=IdentityOp, linear_kv_up_proj=kv_up,
                         q_layernorm=IdentityOp, kv_layernorm=kv_norm)

    return [(MLASelfAttention, "_resolve_qk_norm_config", _resolve_qk_norm_config)]


FIXES = (
    Patch("distopt_fresh_state_dict", "0.16.1", None, _distopt_fresh_state_dict,
          torch_adam_inside_distributed_optimizer),
    Patch("distopt_load_missing_step", "0.16.1", None, _distopt_load_missing_step,
        torch_adam_inside_distributed_optimizer),
    Patch("distopt_shared_step", "0.16.1", None, _distopt_shared_step, torch_adam_inside_distributed_optimizer),
    Patch("load_bytes_weights_only", "0.16.1", None, _load_bytes_weights_only),
    Patch("recompute_norms_without_te", "0.16.1", None, _recompute_norms_without_te, _without_te),
    Patch("moe_router_without_te", "0.16.1", "0.17.0", _moe_router_without_te, _without_te),
    Patch("fsdp_tp_without_te", "0.16.1", "0.18.0", _fsdp_tp_without_te, _without_te),
    Patch("mla_local_core_attention", "0.16.1", None, _mla_local_core_attention),
    Patch("mla_without_te", "0.16.1", "0.17.0", _mla_without_te, _without_te),
    Patch("mla_q_norm_without_q_lora", "0.19.0", None, _mla_q_norm_without_q_lora),
)


def apply_megatron_fixes() -> list[str]:
    """Apply the fixes the installed release needs on this machine (idempotent). Returns their names."""
    return _PATCHES.apply_needed(FIXES)


def applied_fixes() -> list[str]:
    return [fix.name for fix in FIXES if fix.name in _APPLIED]


def disabled(*names: str) -> contextlib.AbstractContextManager[None]:
    """Within the block, the named fixes are undone and not re-applied (to show what they fix)."""
    return _PATCHES.switched_off(names, apply_megatron_fixes)
