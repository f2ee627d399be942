"""Megatron-Core's per-module quantization recipe file (`performance.quant_recipe`): read and checked before launch,
and which precision each GEMM takes under it (the planner's question).

The format is Megatron-Core's (`megatron.core.quantization.quant_config`): `configs` (name → a Transformer Engine
`TEQuantizationParams`: `transformer_engine_config_type`, `training_recipe`, optional `evaluation_recipe`) and
`matchers` (name → `config`, `type: glob`, `pattern`, `enabled`), tried in file order; the first enabled matcher whose
pattern matches a module's path picks its config. A matched module inside a quantized layer takes its config's
recipe (`override_quantized_autocast`, default true); inside a BF16 layer it stays BF16 unless
`override_nonquantized_autocast` (default false). A config without an FP8 or FP4 recipe is BF16.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_FP8 = ("tensorwise", "blockwise", "mxfp8")  # the FP8 recipes a per-module config may name
_RECIPE_KEYS = {"fp8_quantization_recipe", "fp4_quantization_recipe", "fp8_format", "override_quantized_autocast",
                "override_nonquantized_autocast", "tp_only_amax_red", "fp8_param", "fp4_param"}


def precision_of(fp8: str | None, fp4: str | None) -> str:
    """The GEMM precision (the key of the peak table) of an FP8 / FP4 recipe name: nvfp4 (an FP4 recipe), mxfp8,
    fp8 (any other FP8 recipe: tensorwise, delayed, blockwise) or bf16 (neither); the planner prices a run's GEMMs
    and each module's under a recipe file by it."""
    if fp4:
        return "nvfp4"
    if fp8:
        return "mxfp8" if fp8 == "mxfp8" else "fp8"
    return "bf16"


@dataclass(frozen=True)
class Rule:
    """One enabled matcher with its config's training recipe."""

    name: str
    pattern: str
    precision: str  # bf16, fp8, mxfp8, nvfp4
    override_quantized: bool = True
    override_nonquantized: bool = False


def _precision(name: str, recipe: Any) -> tuple[str, bool, bool]:
    if not isinstance(recipe, dict):
        raise ValueError(f"config {name!r}: training_recipe must be a mapping")
    unknown = sorted(set(recipe) - _RECIPE_KEYS)
    if unknown:
        raise ValueError(f"config {name!r}: unknown training_recipe key {unknown[0]!r} (known: "
                         f"{', '.join(sorted(_RECIPE_KEYS))})")
    fp8, fp4 = recipe.get("fp8_quantization_recipe"), recipe.get("fp4_quantization_recipe")
    if fp8 is not None and fp4 is not None:
        raise ValueError(f"config {name!r}: fp8_quantization_recipe and fp4_quantization_recipe are exclusive")
    if fp8 is not None and fp8 not in _FP8:
        raise ValueError(f"config {name!r}: fp8_quantization_recipe {fp8!r} is not one of {', '.join(_FP8)} "
                         "(delayed scaling is not per-module in Megatron-Core; custom recipes are not supported here)")
    if fp4 is not None and fp4 != "nvfp4":
        raise ValueError(f"config {name!r}: fp4_quantization_recipe {fp4!r} is not nvfp4")
    return (precision_of(fp8, fp4), bool(recipe.get("override_quantized_autocast", True)),
            bool(recipe.get("override_nonquantized_autocast", False)))


def parse(data: Any) -> list[Rule]:
    """The enabled matchers of a recipe's parsed YAML, in order; ValueError (one line) naming what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict) or \
            not isinstance(data.get("matchers"), dict):
        raise ValueError("a quantization recipe is a mapping with `configs` and `matchers` mappings")
    configs: dict[str, tuple[str, bool, bool]] = {}
    for name, cfg in data["configs"].items():
        if not isinstance(cfg, dict) or cfg.get("transformer_engine_config_type") != "TEQuantizationParams":
            raise ValueError(f"config {name!r}: transformer_engine_config_type must be TEQuantizationParams")
        if "training_recipe" not in cfg:
            raise ValueError(f"config {name!r} has no training_recipe")
        configs[name] = _precision(name, cfg["training_recipe"] or {})
    rules = []
    for name, m in data["matchers"].items():
        if not isinstance(m, dict):
            raise ValueError(f"matcher {name!r} must be a mapping")
        if not m.get("enabled", False):  # Megatron-Core's default: a matcher without `enabled: true` is skipped
            continue
        if m.get("type") != "glob":
            raise ValueError(f"matcher {name!r}: type {m.get('type')!r} is not glob (Megatron-Core's only kind)")
        if m.get("config") not in configs:
            raise ValueError(f"matcher {name!r} names config {m.get('config')!r}, which `configs` does not define")
        if not isinstance(m.get("pattern"), str):
            raise ValueError(f"matcher {name!r} has no pattern")
        rules.append(Rule(name, m["pattern"], *configs[m["config"]]))
    return rules


def read(path: str | Path) -> list[Rule]:
    """The recipe file's rules; ValueError (one line, naming the file) when it is missing or malformed."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"performance.quant_recipe: cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"performance.quant_recipe: {path} is not YAML ({str(exc).splitlines()[0]})") from None
    try:
        return parse(data)
    except ValueError as exc:
        raise ValueError(f"performance.quant_recipe: {path}: {exc}") from None


def gemm_precision(rules: Sequence[Rule], module_path: str, run: str, layer_quantized: bool) -> str:
    """The precision of the GEMM of module `module_path`: `run` is the run's recipe (bf16, fp8, mxfp8, nvfp4),
    `layer_quantized` whether its layer runs under it (not one of the BF16 first / last layers)."""
    quantized = layer_quantized and run != "bf16"
    rule = next((r for r in rules if fnmatch.fnmatch(module_path, r.pattern)), None)
    if rule is None:
        return run if quantized else "bf16"
    if quantized:
        return rule.precision if rule.override_quantized else run
    return rule.precision if rule.override_nonquantized else "bf16"
