"""The `performance` section: the Megatron-Core settings Megatron-Bridge's per-GPU performance recipes set, passed
through to `TransformerConfig` under Megatron-Core's own names (`model_providers/core/performance.py`; validated by
`pretrain/rules/performance.py`,
counted by the planner where they change time: `pretrain/planner/timing.py`).

The other performance settings already have their keys: FP8 / MXFP8 recipes (`model.fp8`), FP8 parameter
all-gather (`model.fp8_param_gather`), TP communication overlap (`parallel.tp_comm_overlap`), DP overlaps
(`optimizer.overlap_grad_reduce`, `optimizer.overlap_param_gather`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from model_providers.core.knobs import CHANGE, Resume, knob

# CUDA-graph scopes both supported Megatron-Core releases accept (0.19 renamed the field cuda_graph_modules).
CudaGraphScope = Literal["attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba"]
OffloadModule = Literal["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"]


_NUMERICS = Resume(CHANGE, "from the resumed step: the GEMMs' numerics change, the state does not")


@dataclass
class PerformanceConfig:
    """Speed settings that do not change the model's math (GPU only; each refused on CPU by validate). Passed to
    Megatron-Core by `model_providers/core/performance.py` (each only when set, some under a release's name)."""

    RESUME = Resume(CHANGE, "from the resumed step (speed settings: the model's math is the same)")

    # MoE token dispatch through DeepEP / HybridEP (Megatron-Core's "flex" dispatcher); None: model's dispatcher.
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep"] | None = None
    # CUDA graphs: "local" (Megatron-Core's) or "transformer_engine" capture of the scopes below ([] = the layer).
    cuda_graph_impl: Literal["none", "local", "transformer_engine"] = "none"
    cuda_graph_scope: list[CudaGraphScope] | None = None
    # Megatron-Core's layer-wise activation offloading (cpu_offloading): the activations of this many layers (of the
    # first ones) go to host memory in forward and come back for backward; weights stay. No pipeline, no recompute.
    cpu_offloading_num_layers: int | None = knob(None, range=">= 1")
    # Fine-grained activation offloading: the inputs of these submodules go to host memory in forward.
    fine_grained_activation_offloading: bool = False
    offload_modules: list[OffloadModule] | None = None
    # Overlap the MoE all-to-all of one microbatch with another's compute (1F1B A2A overlap).
    overlap_moe_expert_parallel_comm: bool = False
    # Run the shared experts on a side stream, overlapped with the routed experts' dispatch.
    moe_shared_expert_overlap: bool = False
    # The fused cross entropy's implementation (on GPU the loss is fused): Megatron-Core's "native" one keeps an fp32
    # softmax over the vocabulary for backward; Transformer Engine's ("te") writes the gradient into the logits.
    cross_entropy_fusion_impl: Literal["native", "te"] | None = None
    # NVFP4 GEMMs (Transformer Engine on Blackwell); instead of model.fp8.
    fp4_recipe: Literal["nvfp4"] | None = knob(None, resume=_NUMERICS)
    # Under an FP8 or NVFP4 recipe: the first / the last this many decoder layers keep BF16 GEMMs (Megatron-Core's
    # first_last_layers_bf16 with num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16); 0 and 0: none.
    num_layers_at_start_in_bf16: int = knob(0, range=">= 0", resume=_NUMERICS)
    num_layers_at_end_in_bf16: int = knob(0, range=">= 0", resume=_NUMERICS)
    # Megatron-Core's per-module quantization recipe (`quant_recipe`): a YAML file of TEQuantizationParams `configs`
    # and ordered glob `matchers` over module paths (`model_providers/core/quant_recipe.py` reads it), e.g. an NVFP4
    # run's attention projections kept in BF16; null: every GEMM takes the run's recipe.
    quant_recipe: str | None = knob(None, resume=_NUMERICS)


def settings_in_use(perf: PerformanceConfig) -> list[str]:
    """The dotted keys of `perf` that are set (not their defaults)."""
    default = PerformanceConfig()
    return [f"performance.{k}" for k, v in vars(perf).items() if v != getattr(default, k)]
