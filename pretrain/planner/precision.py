"""What a run's GEMM precision means to the planner: the bytes of the low-precision copies Transformer Engine keeps
(`gemm_input_bytes`: activations; `fp8_param_bytes` and `weight_copy_bytes`: weights, read by `planner.static` and
`planner.fsdp`).

Transformer Engine keeps an FP8 tensor as row-wise data and, for the GEMMs that read it transposed (the weight in the
data gradient, the input in the weight gradient), column-wise data. MXFP8 and blockwise FP8 scale blocks along one
axis, so their column-wise data is a second copy always (`MXFP8Tensor`, `Float8BlockwiseQTensor`). A per-tensor-scaled
FP8 tensor (`tensorwise`, `delayed`: `Float8Tensor`) needs its transpose only where the GPU's FP8 GEMMs take the TN
layout alone (Hopper); on Blackwell (`hardware.Gpu.fp8_any_layout`) TE serves column-wise use from the row-wise data and
keeps no transpose (TE `Float8TensorStorage.update_usage` and the C++ `Float8Quantizer::create_tensor`:
`with_transpose = columnwise_usage && !is_non_tn_fp8_gemm_supported`, TE 2.4 and later).
"""

from __future__ import annotations

from pretrain.config import ModelConfig, PerformanceConfig
from pretrain.layout import Layout
from pretrain.planner.hardware import GPUS

FP8_BYTES = 1  # a Transformer Engine FP8 copy keeps one byte per value (scales are negligible)
NVFP4_BYTES = 0.5625  # an NVFP4 copy: 4 bits per value and one FP8 (E4M3) scale per 16 values
TENSOR_SCALED = ("tensorwise", "delayed")  # one scale per tensor: Float8Tensor, whose column-wise use is a transpose


def gemm_input_bytes(m: ModelConfig, perf: PerformanceConfig, lay: Layout) -> float | None:
    """Bytes per value of the copy a low-precision GEMM keeps of its input under Transformer Engine: FP8 and MXFP8 1,
    NVFP4 (performance.fp4_recipe) 0.5625; None: the GEMMs run in the activation dtype (`m`, `perf`: the model and
    performance sections)."""
    if not lay.use_te:
        return None
    if perf.fp4_recipe:
        return NVFP4_BYTES
    return FP8_BYTES if m.fp8 else None


def fp8_transposes(m: ModelConfig, gpu: str | None) -> bool:
    """Whether an FP8 tensor of this recipe (model.fp8) keeps column-wise data beside its row-wise data on `gpu`
    (None: a GPU whose FP8 GEMMs are TN-only, the conservative case)."""
    if m.fp8 not in TENSOR_SCALED:
        return True
    return gpu is None or not GPUS[gpu].fp8_any_layout


def fp8_params(m: ModelConfig, lay: Layout) -> bool:
    """The linear weights are FP8 parameters (`model.fp8_param_gather` under an FP8 recipe, with TE)."""
    return bool(m.fp8) and m.fp8_param_gather and lay.use_te


def weight_copy_bytes(m: ModelConfig, perf: PerformanceConfig, lay: Layout, gpu: str | None) -> float:
    """Bytes per linear-weight element Transformer Engine keeps beside the parameter (the plan's fp8 column).

    FP8 parameters: the parameter is the row-wise data; the column-wise data on top (MXFP8, blockwise; tensor-scaled
    FP8 on Hopper). bf16 parameters under an FP8 recipe: TE's cached FP8 weight (row-wise, + column-wise as above).
    NVFP4 (`performance.fp4_recipe`): a row-wise and a column-wise copy of every weight."""
    if not lay.use_te:
        return 0.0
    if m.fp8:
        column = FP8_BYTES if fp8_transposes(m, gpu) else 0
        return float(column if fp8_params(m, lay) else FP8_BYTES + column)
    if perf.fp4_recipe:
        return 2 * NVFP4_BYTES
    return 0.0
