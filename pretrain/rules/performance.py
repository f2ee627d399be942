"""The `performance` section (`pretrain/performance.py`): what each setting needs — a GPU, Transformer Engine, DeepEP,
experts — checked before launch; Megatron-Core's own TransformerConfig checks follow (`rules/megatron.py`)."""

from __future__ import annotations

import importlib.util

from pretrain.config import ModelConfig, PerformanceConfig
from pretrain.layout import Layout
from pretrain.performance import settings_in_use
from pretrain.problems import Report

# What each setting needs beyond a GPU with Transformer Engine (the message of the refusal on a machine without).
_NEEDS = {
    "performance.moe_flex_dispatcher_backend": "a GPU and DeepEP (the deep_ep package; HybridEP: its hybrid-ep build)",
    "performance.cuda_graph_impl": "a GPU (CUDA graphs)",
    "performance.cuda_graph_scope": "a GPU (CUDA graphs)",
    "performance.cpu_offloading_num_layers": "a GPU (offloads activations to pinned host memory on CUDA streams)",
    "performance.fine_grained_activation_offloading": "a GPU (offloads to pinned host memory on CUDA streams)",
    "performance.offload_modules": "a GPU (offloads to pinned host memory on CUDA streams)",
    "performance.overlap_moe_expert_parallel_comm": "a GPU (overlaps on CUDA streams)",
    "performance.moe_shared_expert_overlap": "a GPU (overlaps on CUDA streams)",
    "performance.cross_entropy_fusion_impl": "a GPU (the fused cross entropy; te: Transformer Engine's)",
    "performance.fp4_recipe": "Transformer Engine on a Blackwell GPU (NVFP4 GEMMs)",
    "performance.num_layers_at_start_in_bf16": "Transformer Engine on a GPU (FP8 / NVFP4 GEMMs)",
    "performance.num_layers_at_end_in_bf16": "Transformer Engine on a GPU (FP8 / NVFP4 GEMMs)",
    "performance.quant_recipe": "Transformer Engine on a GPU (per-module FP8 / NVFP4 GEMMs)",
}


def performance_rules(r: Report, *, model: ModelConfig, performance: PerformanceConfig, lay: Layout | None,
                      te_on_gpu: bool) -> None:
    """Each set key of the performance section: refused where it cannot run (CPU, no TE, no DeepEP) and where the
    model or layout gives it nothing to do."""
    perf, m = performance, model
    used = settings_in_use(perf)
    for key in used:
        if not te_on_gpu:
            r.error(key, f"{key} needs {_NEEDS[key]}; this machine has no CUDA with Transformer Engine",
                    f"drop {key} here, or check the cluster job with `validate --world-size N` (a GPU dry run)")
    experts = bool(m.num_moe_experts)
    if perf.moe_flex_dispatcher_backend:
        if not experts:
            r.error("performance.moe_flex_dispatcher_backend", "performance.moe_flex_dispatcher_backend is set but "
                    "the model has no experts (model.num_moe_experts)", "drop performance.moe_flex_dispatcher_backend")
        elif te_on_gpu and _cuda_here() and importlib.util.find_spec("deep_ep") is None:
            r.error("performance.moe_flex_dispatcher_backend", f"performance.moe_flex_dispatcher_backend="
                    f"{perf.moe_flex_dispatcher_backend} needs DeepEP, which is not installed (import deep_ep fails)",
                    "install DeepEP on the GPU nodes, or drop performance.moe_flex_dispatcher_backend")
    if perf.cuda_graph_scope and perf.cuda_graph_impl == "none":
        r.error(("performance.cuda_graph_scope", "performance.cuda_graph_impl"), "performance.cuda_graph_scope is set "
                "but performance.cuda_graph_impl=none captures nothing", "set performance.cuda_graph_impl=local or "
                "transformer_engine (or drop performance.cuda_graph_scope)")
    if perf.fine_grained_activation_offloading != bool(perf.offload_modules):
        r.error(("performance.fine_grained_activation_offloading", "performance.offload_modules"),
                "fine-grained activation offloading needs both performance.fine_grained_activation_offloading=true "
                "and the submodules to offload (performance.offload_modules)", "set both, or neither")
    if perf.overlap_moe_expert_parallel_comm and (not experts or (lay is not None and lay.ep == 1)):
        r.error(("performance.overlap_moe_expert_parallel_comm", "parallel.expert"),
                "performance.overlap_moe_expert_parallel_comm overlaps the expert-parallel all-to-all, and this run "
                "has none (no experts, or parallel.expert=1)", "drop it, or use parallel.expert > 1")
    if perf.overlap_moe_expert_parallel_comm and lay is not None and lay.precision == "fp32":
        r.error(("performance.overlap_moe_expert_parallel_comm", "train.precision"), "Megatron-Core overlaps the "
                "expert-parallel all-to-all only for bf16 or fp16 models", "set train.precision=bf16")
    if perf.moe_shared_expert_overlap and not m.moe_shared_expert_intermediate_size:
        r.error("performance.moe_shared_expert_overlap", "performance.moe_shared_expert_overlap is set but the model "
                "has no shared experts (model.moe_shared_expert_intermediate_size)", "drop it")
    if perf.moe_shared_expert_overlap and "shared_experts" in (m.recompute_modules or ()):
        r.error(("performance.moe_shared_expert_overlap", "model.recompute_modules"), "Megatron-Core cannot recompute "
                "the shared experts while overlapping them (recompute_modules shared_experts)", "drop one of them")
    n = perf.cpu_offloading_num_layers
    if n is not None and n >= max(1, m.num_layers):  # below 1: its declared range
        r.error("performance.cpu_offloading_num_layers", f"performance.cpu_offloading_num_layers={n} must be less "
                f"than the model's {m.num_layers} layers", "set it in that range, or to null")
    if n and perf.fine_grained_activation_offloading:
        r.error(("performance.cpu_offloading_num_layers", "performance.fine_grained_activation_offloading"),
                "Megatron-Core offloads activations one way at a time: layer-wise (cpu_offloading_num_layers) or "
                "fine-grained", "set one of them")
    if perf.fp4_recipe and m.fp8:
        r.error(("performance.fp4_recipe", "model.fp8"), "performance.fp4_recipe and model.fp8 both choose the GEMM "
                "precision", "set one of them")
    _quantization_rules(r, m, perf, lay)


def _quantization_rules(r: Report, m: ModelConfig, perf: PerformanceConfig, lay: Layout | None) -> None:
    """The BF16 first / last layers and the per-module recipe: only under an FP8 or NVFP4 recipe, within one
    pipeline stage's layers (Megatron-Core's bound), the recipe file readable and well-formed."""
    bf16_layers = [k for k in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16") if getattr(perf, k)]
    keys = [f"performance.{k}" for k in bf16_layers] + (["performance.quant_recipe"] if perf.quant_recipe else [])
    if keys and not (m.fp8 or perf.fp4_recipe):
        r.error(tuple(keys), f"{keys[0]} chooses GEMMs to keep out of an FP8 or NVFP4 recipe, and this run has none",
                "set model.fp8 or performance.fp4_recipe, or drop it")
    if bf16_layers and m.fp8 == "delayed":
        r.error((f"performance.{bf16_layers[0]}", "model.fp8"), "Megatron-Core keeps no layer in BF16 under delayed "
                "scaling", "use model.fp8=tensorwise or mxfp8, or drop it")
    per_stage = m.num_layers // (lay.pp if lay is not None else 1)
    for k in bf16_layers:
        if getattr(perf, k) > per_stage:
            r.error(f"performance.{k}", f"performance.{k}={getattr(perf, k)} is more than one pipeline stage's "
                    f"{per_stage} layers (Megatron-Core's bound)", f"set it to at most {per_stage}")
    if perf.quant_recipe:
        from model_providers.core.quant_recipe import read

        try:
            read(perf.quant_recipe)
        except ValueError as exc:
            r.error("performance.quant_recipe", str(exc), "fix the file (Megatron-Core's quantization recipe format)")


def _cuda_here() -> bool:
    """This machine has CUDA (a GPU dry run on a login node checks the job, not the login node's packages)."""
    from pretrain.compat.cuda import cuda_available

    return cuda_available()
