"""Which of Megatron-Core's fused kernels the model uses: one rule read by the builder (the
`TransformerConfig` flags) and by the planner (the bytes each path keeps for backward). No torch import."""

from __future__ import annotations

import importlib.util
from typing import Any


def bias_activation_fusion(model: Any, on_gpu: bool, te: bool | None = None) -> bool:
    """Megatron's fused bias+activation: SwiGLU for gated SiLU (`bias_swiglu_impl`, keeps only the fc1
    output for backward), bias-GELU for ungated GELU with biases, and the experts' weighted quick-GeGLU (with
    GPT-OSS's clamp and linear offset: `weighted_bias_quick_geglu_impl`, Transformer Engine's grouped experts only:
    every MLP an expert, no shared experts; `te`: the run uses Transformer Engine's spec, None: unless
    model.transformer_impl is local). GPU only by default (the kernels are `torch.compile`d);
    `model.bias_activation_fusion` true/false forces it."""
    forced = getattr(model, "bias_activation_fusion", None)
    supported = (model.gated_linear_unit and model.activation == "silu") or (
        not model.gated_linear_unit and model.activation == "gelu" and model.add_bias_linear is True) or (
        _quick_geglu_experts(model, te))
    if forced is not None:
        return bool(forced) and supported
    return on_gpu and supported


def _quick_geglu_experts(model: Any, te: bool | None) -> bool:
    """Gated quick-GELU whose every MLP is a grouped Transformer Engine expert (TEGroupedMLP fuses it; Megatron-Core's
    dense MLP does not)."""
    experts = bool(getattr(model, "num_moe_experts", None)) and getattr(model, "moe_layer_freq", 1) == 1
    return bool(model.gated_linear_unit and model.activation == "quick_gelu" and experts
                and not getattr(model, "moe_shared_expert_intermediate_size", None)
                and getattr(model, "moe_grouped_gemm", None) is not False
                and (te if te is not None else getattr(model, "transformer_impl", "auto") != "local"))


def masked_softmax_fusion(on_gpu: bool, per_document_mask: bool = False, windowed: bool = False) -> bool:
    """Megatron's fused scale-mask-softmax for the local spec needs CUDA extensions that megatron-core does not
    ship (`scaled_masked_softmax_cuda`, from apex or Megatron-LM's fused kernels): on when they import.

    Off with a per-document attention mask (`data.reset_attention_mask`): for causal attention the fused path is
    the upper-triangular kernel, which ignores an explicit mask (`fused_softmax.py`, `forward_fused_softmax`), and
    its sliding window (`window_size` is applied only by `forward_torch_softmax`): off with a window too."""
    if not on_gpu or per_document_mask or windowed:
        return False
    return all(importlib.util.find_spec(name) is not None
               for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"))
