"""Compatibility with the supported Megatron-Core releases and with CPU-only machines, in one package.

- `mcore`: the installed megatron-core release and one adapter for every API that differs between the
  supported releases (0.16.1 – 0.19.x), chosen by version in one place.
- `megatron_fixes`: run-time fixes of Megatron-Core bugs, each naming the releases it is needed on.
- `cpu_shims`: Megatron-Core's CUDA assumptions worked around on CPU (gloo), each naming its releases.
- `matrix`: the supported range and the tested Python × megatron-core × Transformer Engine × torch
  combinations (`python -m pretrain validate` reports and checks them).

Entry points that build Megatron objects call `apply()` once at start-up (`pretrain.train.train` does it
first); nothing is patched lazily elsewhere.
"""

from __future__ import annotations


def apply(on_gpu: bool | None = None) -> list[str]:
    """Apply the CPU shims (without CUDA) and the Megatron fixes the installed release needs (idempotent).

    Returns the names of everything in effect, CPU shims prefixed with "cpu:".
    """
    import torch

    from pretrain.compat.cpu_shims import apply_cpu_shims
    from pretrain.compat.megatron_fixes import apply_megatron_fixes

    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    applied = [] if on_gpu else [f"cpu:{name}" for name in apply_cpu_shims()]
    return applied + apply_megatron_fixes()


def import_megatron(on_gpu: bool) -> None:
    """Import megatron.core as `apply()` first imports it (without CUDA: optional imports deferred, torch.compile off
    during the import), and patch nothing else: for code that only builds Megatron's config objects (validation,
    which runs in processes, e.g. the planner's and the tests', that must keep torch as it is)."""
    if on_gpu:
        import megatron.core  # noqa: F401
        return
    from pretrain.compat.cpu_shims import _no_torch_compile
    from pretrain.compat.deferred_imports import first_import

    first_import(_no_torch_compile())
