"""Rules for `model.recompute_modules` (selective recompute), as (keys, message, fix) for `pretrain.validate`."""

from __future__ import annotations

from typing import Any

Problem = tuple[tuple[str, ...] | str, str, str]


def recompute_problems(m: Any, use_te: bool) -> list[Problem]:
    """Only with selective recompute, not empty, no module twice, not a no-op (layernorm under the TE spec of a dense
    model, mlp on MoE layers), moe / moe_act only on MoE models, moe_act only with grouped-GEMM experts."""
    mods = m.recompute_modules
    if mods is None:
        return []
    if m.recompute_granularity != "selective":
        return [(("model.recompute_modules", "model.recompute_granularity"),
                 "model.recompute_modules is only used with model.recompute_granularity=selective",
                 "set model.recompute_granularity=selective or model.recompute_modules=null")]
    out: list[Problem] = []
    if not mods:
        out.append(("model.recompute_modules", "model.recompute_modules=[] recomputes nothing",
                    "list modules (core_attn, mlp, layernorm) or set model.recompute_granularity=null"))
    if len(set(mods)) != len(mods):
        out.append(("model.recompute_modules", f"model.recompute_modules={mods} names a module twice",
                    "list each module once"))
    if "layernorm" in mods and use_te and not m.num_moe_experts:  # an MoE layer's pre-MLP norm is its own TENorm
        out.append((("model.recompute_modules", "model.transformer_impl"),
                    "recompute of layernorm does nothing with the Transformer Engine spec on a dense model (both "
                    "norms are fused into the following linear layers)",
                    "remove layernorm, or set model.transformer_impl=local"))
    return out + _moe_problems(m, mods, use_te)


def _moe_problems(m: Any, mods: list[str], use_te: bool) -> list[Problem]:
    """moe (the whole MoE layer, Megatron-Core's `MoELayer` checkpoint) and moe_act (the experts' activation:
    `TEGroupedMLP` / `GroupedMLP` only, megatron-core 0.16.1 refuses it with `SequentialMLP`)."""
    moe_mods = [x for x in mods if x in ("moe", "moe_act")]
    if not m.num_moe_experts:
        if not moe_mods:
            return []
        names = ", ".join(moe_mods)
        return [(("model.recompute_modules", "model.num_moe_experts"),
                 f"recompute of {names} needs MoE layers and this model is dense (model.num_moe_experts=null)",
                 f"remove {names} (mlp recomputes a dense model's MLP)")]
    out: list[Problem] = []
    if "mlp" in mods:
        out.append(("model.recompute_modules", "recompute of mlp does nothing on MoE layers (Megatron-Core skips "
                    "them)", "use moe (the whole MoE layer) instead of mlp"))
    grouped = use_te if m.moe_grouped_gemm is None else m.moe_grouped_gemm
    if "moe_act" in mods and not grouped:
        out.append((("model.recompute_modules", "model.moe_grouped_gemm"),
                    "recompute of moe_act needs the grouped-GEMM experts of the Transformer Engine spec "
                    "(megatron-core refuses it with the local spec's SequentialMLP)",
                    "use moe (the whole MoE layer), or run on a GPU with transformer-engine"))
    if "moe_act" in mods and m.fp8 == "delayed":
        out.append((("model.recompute_modules", "model.fp8"),
                    "recompute of moe_act does not work with delayed FP8 scaling (megatron-core)",
                    "set model.fp8=tensorwise, or remove moe_act"))
    return out
