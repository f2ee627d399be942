"""Model providers: presets, Megatron-Core `GPTModel` construction and HF mapping tables per family.

Importing this package is cheap (no torch): the family modules hold data; `builder` builds models.
"""

from __future__ import annotations

import warnings
from types import ModuleType

from model_providers import gpt, llama

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")

FAMILIES: dict[str, ModuleType] = {"llama": llama, "gpt": gpt}


def all_presets() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for module in FAMILIES.values():
        out.update(module.PRESETS)
    return out


def get_preset(name: str) -> dict:
    """The model fields of a preset (a copy), with `preset` set to its name."""
    presets = all_presets()
    if name not in presets:
        raise KeyError(f"unknown model.preset '{name}' (known: {', '.join(sorted(presets))})")
    return {**presets[name], "preset": name}


def get_family(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise KeyError(f"unknown model.family '{name}' (known: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[name]
