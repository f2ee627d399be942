"""What a run's GEMM precision means to the planner: the bytes of the low-precision copies Transformer Engine keeps
(`gemm_input_bytes`: activations; weights in `planner.static`)."""

from __future__ import annotations

from pretrain.config import Config
from pretrain.layout import Layout

FP8_BYTES = 1  # a Transformer Engine FP8 copy keeps one byte per value (scales are negligible)
NVFP4_BYTES = 0.5625  # an NVFP4 copy: 4 bits per value and one FP8 (E4M3) scale per 16 values


def gemm_input_bytes(cfg: Config, lay: Layout) -> float | None:
    """Bytes per value of the copy a low-precision GEMM keeps of its input under Transformer Engine: FP8 and MXFP8 1,
    NVFP4 (performance.fp4_recipe) 0.5625; None: the GEMMs run in the activation dtype."""
    if not lay.use_te:
        return None
    if cfg.performance.fp4_recipe:
        return NVFP4_BYTES
    return FP8_BYTES if cfg.model.fp8 else None
