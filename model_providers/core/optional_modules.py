"""The model modules built on Megatron-Core's `megatron.core.ssm` (which imports triton in some releases), imported
only by models that have their layers: a dense or MoE model builds where triton is not installed, and a model that
needs a missing module is refused in one line (`missing_dependency`, read by `pretrain/rules/megatron.py`)."""

from __future__ import annotations

import importlib
from typing import Any

from model_providers.core import hybrid
from model_providers.core.linear_layers import has_linear_attention

_FEATURE_MODULES = {"mamba_builder": (hybrid.is_hybrid, "Mamba-2 layers (model.hybrid_layer_pattern)"),
                    "linear_attention": (has_linear_attention, "Gated DeltaNet layers (model.linear_attention_freq)")}


def feature(name: str):
    """`model_providers.core.<name>` (see `_FEATURE_MODULES`), imported on first use."""
    return importlib.import_module(f"model_providers.core.{name}")


def missing_dependency(plan: Any) -> str | None:
    """Why this model's layers cannot be built here: a module its feature needs is not installed (None when none)."""
    m = plan.config
    for name, (used, what) in _FEATURE_MODULES.items():
        if not used(m):
            continue
        try:
            feature(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.startswith(("model_providers", "megatron")):
                raise
            hint = " (CUDA builds of torch bring it)" if exc.name == "triton" else ""
            return (f"{what} are built from Megatron-Core's megatron.core.ssm, which imports `{exc.name}`: it is "
                    f"not installed here; `pip install {exc.name}`{hint}")
    return None
