"""The `performance` config section's `TransformerConfig` arguments (`pretrain/performance.py` holds the keys)."""

from __future__ import annotations

from typing import Any


def performance_kwargs(perf: Any, moe: bool, mcore_fields: set[str]) -> dict[str, Any]:
    """The `TransformerConfig` arguments of `perf` (only the ones set; `mcore_fields`: the release's field names)."""
    out: dict[str, Any] = {}
    if perf.moe_flex_dispatcher_backend and moe:
        out.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=perf.moe_flex_dispatcher_backend)
    if perf.cuda_graph_impl != "none":
        out["cuda_graph_impl"] = perf.cuda_graph_impl
        if perf.cuda_graph_scope:
            name = "cuda_graph_modules" if "cuda_graph_modules" in mcore_fields else "cuda_graph_scope"
            out[name] = list(perf.cuda_graph_scope)
    if perf.cpu_offloading_num_layers:
        out.update(cpu_offloading=True, cpu_offloading_num_layers=perf.cpu_offloading_num_layers,
                   cpu_offloading_activations=True, cpu_offloading_weights=False)
    if perf.fine_grained_activation_offloading:
        out.update(fine_grained_activation_offloading=True, offload_modules=list(perf.offload_modules or []))
    if perf.overlap_moe_expert_parallel_comm:
        out["overlap_moe_expert_parallel_comm"] = True
    if perf.moe_shared_expert_overlap:
        out["moe_shared_expert_overlap"] = True
    if perf.cross_entropy_fusion_impl:
        out["cross_entropy_fusion_impl"] = perf.cross_entropy_fusion_impl
    if perf.fp4_recipe:
        out.update(fp4="e2m1", fp4_recipe=perf.fp4_recipe)
    if perf.num_layers_at_start_in_bf16 or perf.num_layers_at_end_in_bf16:
        out.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=perf.num_layers_at_start_in_bf16,
                   num_layers_at_end_in_bf16=perf.num_layers_at_end_in_bf16)
    if perf.quant_recipe:  # checked before launch (model_providers/core/quant_recipe.py); Megatron-Core's reader here
        from megatron.core.quantization.utils import load_quantization_recipe

        out["quant_recipe"] = load_quantization_recipe(perf.quant_recipe)
    return out
