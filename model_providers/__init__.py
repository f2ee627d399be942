"""Model providers: one module per model family, found here and iterated by the rest of the program.

Each `model_providers/<family>.py` defines `FAMILY`, a `core.family.Family` (presets, HF architecture,
mapping table, HF config both ways). Importing this package is cheap (no torch); `core.builder` builds models.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import warnings
from typing import Any

from model_providers.core.family import Family

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")
os.environ.setdefault("NO_VCS_VERSION", "1")  # megatron-core's plain version (see pretrain/__init__.py)


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg or info.name.startswith("_"):
            continue
        family = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            if family.name in found:
                raise RuntimeError(f"model family '{family.name}' is defined twice")
            found[family.name] = family
    return dict(sorted(found.items()))


FAMILIES: dict[str, Family] = _discover()
DEFAULT_FAMILY = "llama"  # model.family when neither the config nor its preset names one


def all_presets() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for family in FAMILIES.values():
        for name, preset in family.presets.items():
            if name in out:
                raise RuntimeError(f"model preset '{name}' is defined by two families")
            out[name] = preset
    return out


def get_preset(name: str) -> dict:
    """The model fields of a preset (a copy), with `preset` set to its name."""
    presets = all_presets()
    if name not in presets:
        raise KeyError(f"unknown model.preset '{name}' (known: {', '.join(sorted(presets))})")
    return {**presets[name], "preset": name}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise KeyError(f"unknown model.family '{name}' (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def family_for_hf(hf_cfg: Any) -> Family:
    """The family whose HF `model_type` a transformers config has (ConversionError if none)."""
    from model_providers.core.mapping import ConversionError

    for family in FAMILIES.values():
        if family.matches_hf(hf_cfg):
            return family
    archs = ", ".join(getattr(hf_cfg, "architectures", None) or []) or "no architectures"
    known = ", ".join(f.hf_model_type for f in FAMILIES.values())
    raise ConversionError(f"config.json: model_type {getattr(hf_cfg, 'model_type', None)!r} ({archs}) "
                          f"is not supported ({known})")
