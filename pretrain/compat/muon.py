"""Megatron-Core's Muon across the supported releases, and emerging-optimizers on Python 3.11.

Both releases build Muon from the `emerging-optimizers` package (`pip install emerging-optimizers`; `make install`
installs it):

- 0.16.1: `megatron.core.optimizer.muon.get_megatron_muon_optimizer(config, chunks, layer_wise_distributed_
  optimizer=...)`; its `TensorParallelMuon` was written against emerging-optimizers 0.1, whose
  `OrthogonalizedOptimizer` took `use_nesterov=` and whose `newton_schulz_tp` took `mode=`. The release on PyPI
  (0.3) names them `nesterov=` and `tp_mode=`: `_Muon016` below passes the same values under the new names (the
  Newton-Schulz name only while Megatron's `orthogonalize` runs). The Newton-Schulz coefficients are fixed to
  "quintic" there (validation refuses others).
- 0.19.x: `get_megatron_optimizer` with `config.optimizer="muon"` and `use_layer_wise_distributed_optimizer`.

emerging-optimizers declares Python >= 3.12 and imports `typing.override` (new in 3.12, a marker decorator); on
3.10/3.11 (the test configuration `scripts/install.sh` installs with --ignore-requires-python) the name is added
(the identity) before anything imports the package: by the `.pth` file the installer writes into the venv
(megatron-core 0.19 imports the package with `megatron.core`), and by `backfill_typing_override` here.
"""

from __future__ import annotations

import typing
from typing import Any

from pretrain.compat.mcore import MCORE, _pick, _substituted

# The optimizer.muon keys feed OptimizerConfig under 0.19's names (`mcore=OPT.named(...)` in pretrain/config.py);
# 0.16.1 names nesterov otherwise and has no coefficient set (None: the release has no such field).
MUON_RENAMED: dict[str, str | None] = _pick({"0.16.1": {"muon_nesterov": "muon_use_nesterov",
                                                        "muon_coefficient_type": None}, "0.19.0": {}})
COEFFICIENTS_FIXED = MUON_RENAMED.get("muon_coefficient_type", "") is None  # this release always uses "quintic"


def muon_fields(declared: dict[str, Any]) -> dict[str, Any]:
    """The optimizer.muon values under 0.19's OptimizerConfig names, renamed (or dropped) for this release."""
    out = {}
    for name, value in declared.items():
        name = MUON_RENAMED.get(name, name)
        if name is not None:
            out[name] = value
    return out
# Megatron-Core's LayerWiseDistributedOptimizer in fp32 runs (measured on CPU, DP2, tests/pretrain/test_muon.py)
LAYER_WISE_FP32: str = _pick({
    "0.16.1": "its checkpoints fail in fp32: LayerWiseDistributedOptimizer.sharded_state_dict reads each chained "
              "optimizer's sd['optimizer'], which only the 16-bit wrapper has (KeyError: 'optimizer', "
              "optimizer/layer_wise_optimizer.py:289)",
    "0.19.0": "its first step fails in fp32: the Muon it chains is not wrapped in Megatron's FP32Optimizer "
              "(AttributeError: 'TensorParallelMuon' object has no attribute 'get_loss_scale')",
})


def backfill_typing_override() -> None:
    """`typing.override` on Python < 3.12 (emerging-optimizers imports it; it only marks methods), as the `.pth`
    file `scripts/install.sh` writes does at start-up."""
    if not hasattr(typing, "override"):
        typing.override = lambda method: method


def emerging_optimizers_missing() -> str | None:
    """Why Muon cannot be built here (None: it can)."""
    backfill_typing_override()
    try:
        import emerging_optimizers.orthogonalized_optimizers  # noqa: F401
    except ImportError as exc:
        return f"the emerging-optimizers package does not import ({exc}); `make install` installs it"
    return None


def _build_0_16(config, chunks: list, layer_wise: bool):
    from megatron.core.optimizer import muon as muon_module

    with _substituted(muon_module, "TensorParallelMuon", _muon_016_class()):
        return muon_module.get_megatron_muon_optimizer(config, chunks, layer_wise_distributed_optimizer=layer_wise)


def _build_0_19(config, chunks: list, layer_wise: bool):
    from megatron.core.optimizer import get_megatron_optimizer

    config.optimizer = "muon"
    config.use_layer_wise_distributed_optimizer = layer_wise
    return get_megatron_optimizer(config, chunks)


_MUON_016 = None


def _muon_016_class() -> type:
    """0.16.1's TensorParallelMuon over emerging-optimizers >= 0.2 (keyword names only; same computation)."""
    global _MUON_016
    if _MUON_016 is not None:
        return _MUON_016
    from emerging_optimizers.orthogonalized_optimizers import OrthogonalizedOptimizer
    from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz_tp
    from megatron.core.optimizer import muon as muon_module

    def newton_schulz_tp_mode(*args: Any, mode: str = "duplicated", **kwargs: Any):
        return newton_schulz_tp(*args, tp_mode=mode, **kwargs)

    class _NesterovKeyword(OrthogonalizedOptimizer):
        def __init__(self, params, lr, momentum, *, use_nesterov: bool, **kwargs: Any) -> None:
            super().__init__(params, lr, momentum, nesterov=use_nesterov, **kwargs)

    class _Muon016(muon_module.TensorParallelMuon, _NesterovKeyword):
        def orthogonalize(self, p, grad, **kwargs: Any):
            with _substituted(muon_module, "newton_schulz_tp", newton_schulz_tp_mode):
                return super().orthogonalize(p, grad, **kwargs)

    _Muon016.__name__ = _Muon016.__qualname__ = "TensorParallelMuon"
    _MUON_016 = _Muon016
    return _MUON_016


_build = _pick({"0.16.1": _build_0_16, "0.19.0": _build_0_19})


def build_muon(config, chunks: list, layer_wise: bool):
    """Megatron-Core's Muon + AdamW chain for `chunks` from a Megatron `OptimizerConfig` holding the muon_* fields;
    `layer_wise`: its LayerWiseDistributedOptimizer (parameters sharded whole over data parallel)."""
    backfill_typing_override()
    return _build(config, chunks, layer_wise)


__all__ = ["COEFFICIENTS_FIXED", "LAYER_WISE_FP32", "MCORE", "MUON_RENAMED", "backfill_typing_override", "build_muon",
           "emerging_optimizers_missing", "muon_fields"]
