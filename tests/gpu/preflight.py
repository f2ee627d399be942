"""Before the GPU check runs anything: can this Python run it, and is there a CUDA GPU?

`tests/gpu/run.sh` (through check.py) exits 0 without running anything only when there truly is no GPU: torch,
the project and megatron-core import, `torch.cuda.is_available()` is False and the machine shows no NVIDIA device.
An import that fails, or GPUs that torch cannot use (a CPU build of torch, a driver torch refuses), is a failure:
one line saying what failed, exit 1. Imports only the standard library at module level.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from pathlib import Path

PREFIX = "tests/gpu/run.sh:"


def _failure(what: str, exc: BaseException) -> str:
    """`what` failed: the exception's type, message and the frame that raised it, on one line."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = " ".join(str(exc).split()) or "(no message)"
    return (f"{PREFIX} the GPU check cannot run with {sys.executable}: {what} failed: {type(exc).__name__}: "
            f"{message}{where}")


def nvidia_devices(dev: Path = Path("/dev")) -> list[str]:
    """The NVIDIA device files of this machine (`/dev/nvidia0`, ...): GPUs the driver exposes."""
    try:
        return sorted(p.name for p in dev.glob("nvidia[0-9]*"))
    except OSError:
        return []


def cuda_verdict(available: bool, torch_version: str, cuda_build: str | None, devices: list[str],
                 said: list[str]) -> tuple[int | None, str]:
    """(exit status or None to go on, the line to print) from what torch says and the devices the machine shows.

    `said`: the warnings torch gave while answering `is_available()` (e.g. a driver it refuses)."""
    if available:
        return None, ""
    if not devices:
        return 0, (f"{PREFIX} no CUDA GPU here (torch.cuda.is_available() is False with {sys.executable}); nothing "
                   "to check. Run it on an H100/H200.")
    build = f"CUDA {cuda_build} build" if cuda_build else "a CPU-only build (torch.version.cuda is None)"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    reasons = [*said, *([f"CUDA_VISIBLE_DEVICES={hidden!r}"] if hidden is not None else [])]
    return 1, (f"{PREFIX} this machine has NVIDIA devices ({', '.join(devices)}) but torch {torch_version} "
               f"({build}) cannot use them: torch.cuda.is_available() is False"
               + (f" ({'; '.join(' '.join(r.split()) for r in reasons)})" if reasons else ""))


def check(dry_run: bool = False) -> tuple[int | None, str]:
    """(exit status or None when the check can go on, the line to print). A dry run needs no GPU."""
    try:
        import torch
    except BaseException as exc:  # noqa: BLE001 — a broken torch is what this reports
        return 1, _failure("import torch", exc)
    try:
        import pretrain.compat  # noqa: F401  (the project: check.py puts the checkout first on sys.path)
    except BaseException as exc:  # noqa: BLE001
        return 1, _failure("import pretrain (the project)", exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            available = bool(torch.cuda.is_available())
        except BaseException as exc:  # noqa: BLE001
            return 1, _failure("torch.cuda.is_available()", exc)
    try:
        from pretrain.compat import import_megatron

        import_megatron(on_gpu=available)
    except BaseException as exc:  # noqa: BLE001
        return 1, _failure("import megatron.core", exc)
    if dry_run:
        return None, ""
    said = [str(w.message) for w in caught if "cuda" in str(w.message).lower()]
    return cuda_verdict(available, torch.__version__, torch.version.cuda, nvidia_devices(), said)
