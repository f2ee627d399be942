"""Megatron-Core's `OptimizerConfig` from the optimizer section: the sibling of `builder.transformer_config`.

Every optimizer field declared `mcore=OPT` (`model_providers/core/knobs.py`) passes by name; the derived values (the
16-bit flags and parameter dtype of the layout, the distributed optimizer) are named here. The trainer builds its
optimizer with it (`pretrain/run/setup.py`); validation builds it too, for Megatron-Core's own checks
(`pretrain/rules/megatron.py`).
"""

from __future__ import annotations

from typing import Any

from model_providers.core.knobs import OPT, mcore_kwargs


def optimizer_config(o: Any, layout: Any):
    """Megatron-Core's `OptimizerConfig`: Adam(W), the distributed optimizer when optimizer.distributed or FSDP
    (`o`: the optimizer section; `layout`: the run's `Layout`, for its precision and parameter dtype)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", **mcore_kwargs(o, OPT),  # the optimizer section's fields declared mcore=OPT
        bf16=layout.precision == "bf16", fp16=layout.precision == "fp16", params_dtype=layout.params_dtype,
        use_distributed_optimizer=o.distributed or o.fsdp, overlap_param_gather_with_optimizer_step=False,
    )
