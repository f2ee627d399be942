"""Whether this machine has CUDA, answered without importing torch where the installed build settles it.

`torch.cuda.is_available()` is False on a torch built without CUDA or ROCm whatever the machine holds, and such a
build says so in its `torch/version.py` (`cuda = None`, `hip = None`). Importing torch to ask costs 1–2 s, most of
a warm `python -m pretrain validate`; that file is read instead. Any other build (or torch already imported, or
the file unreadable) is asked the ordinary way.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

_NONE = {name: re.compile(rf"^{name}\s*(:[^=\n]*)?=\s*None\s*$", re.MULTILINE) for name in ("cuda", "hip")}


def torch_build_without_gpu() -> bool:
    """True when the installed torch was built with neither CUDA nor ROCm (read from its `version.py`)."""
    try:
        spec = importlib.util.find_spec("torch")  # a top-level package: found, not imported
        if spec is None or not spec.submodule_search_locations:
            return False
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text(encoding="utf-8")
    except (OSError, ValueError, StopIteration):
        return False
    return all(pattern.search(text) for pattern in _NONE.values())


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, without importing torch when its build has no GPU support."""
    if "torch" not in sys.modules and torch_build_without_gpu():
        return False
    import torch

    return torch.cuda.is_available()
