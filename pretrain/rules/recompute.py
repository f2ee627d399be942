"""Rules for `model.recompute_modules` (selective recompute), as (keys, message, fix) for `pretrain.validate`."""

from __future__ import annotations

from typing import Any

Problem = tuple[tuple[str, ...] | str, str, str]


def recompute_problems(m: Any, use_te: bool) -> list[Problem]:
    """Only with selective recompute, not empty, no module twice, not a no-op (layernorm where the TE spec fuses both
    norms, mlp on a model without dense layers), moe / moe_act / shared_experts only on MoE models (shared_experts
    with shared experts, not overlapped), moe_act only with grouped-GEMM experts, mla_up_proj only with MLA."""
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
    if "layernorm" in mods and use_te and not (m.multi_latent_attention or m.num_moe_experts):
        out.append((("model.recompute_modules", "model.transformer_impl"),
                    "recompute of layernorm does nothing with the Transformer Engine spec on a dense model "
                    "without MLA (both norms are fused into the following linear layers)",
                    "remove layernorm, or set model.transformer_impl=local"))
    if "mla_up_proj" in mods and not m.multi_latent_attention:
        out.append((("model.recompute_modules", "model.multi_latent_attention"),
                    "recompute of mla_up_proj needs multi-latent attention (model.multi_latent_attention=false; "
                    "megatron-core refuses it)", "remove mla_up_proj"))
    return out + _moe_problems(m, mods, use_te)


def _has_dense_layers(m: Any) -> bool:
    """Whether some decoder layer has a dense MLP (Megatron-Core's `moe_layer_freq`: a 0 in the list, or every
    n-th layer MoE with n > 1)."""
    freq = m.moe_layer_freq
    return (0 in freq) if isinstance(freq, list) else freq > 1


def _moe_problems(m: Any, mods: list[str], use_te: bool) -> list[Problem]:
    """moe (the whole MoE layer, Megatron-Core's `MoELayer` checkpoint) and moe_act (the experts' activation:
    `TEGroupedMLP` / `GroupedMLP` only, megatron-core 0.16.1 refuses it with `SequentialMLP`)."""
    moe_mods = [x for x in mods if x in ("moe", "moe_act", "shared_experts")]
    if not m.num_moe_experts:
        if not moe_mods:
            return []
        names = ", ".join(moe_mods)
        return [(("model.recompute_modules", "model.num_moe_experts"),
                 f"recompute of {names} needs MoE layers and this model is dense (model.num_moe_experts=null)",
                 f"remove {names} (mlp recomputes a dense model's MLP)")]
    out: list[Problem] = []
    if "mlp" in mods and not _has_dense_layers(m):
        out.append(("model.recompute_modules", "recompute of mlp does nothing on MoE layers (Megatron-Core skips "
                    "them) and every layer of this model is MoE", "use moe (the whole MoE layer) instead of mlp"))
    if "shared_experts" in mods and not m.moe_shared_expert_intermediate_size:
        out.append((("model.recompute_modules", "model.moe_shared_expert_intermediate_size"),
                    "recompute of shared_experts needs shared experts "
                    "(model.moe_shared_expert_intermediate_size=null)", "remove shared_experts"))
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
