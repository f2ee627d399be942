"""The `Family` base: everything the program knows about one model family, in one object.

A family module (`model_providers/<family>.py`) defines `FAMILY = SomeFamily(...)`: its presets, the HF
architecture it maps to, its mapping table (rule objects from `core.mapping`), and the translation of a
transformers `config.json` into our `model.*` fields and back. The registry in `model_providers/__init__.py`
finds every such module, so adding a family is adding one file.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from model_providers.core.mapping import ConversionError, Dims, MappingRule


def shape(base: Mapping, layers: int, hidden: int, ffn: int, heads: int, groups: int | None, **fields: Any) -> dict:
    """A preset: `base` fields plus the transformer shape (layers, hidden, FFN, heads, query groups) and `fields`."""
    return {**base, "num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_attention_heads": heads,
            "num_query_groups": groups, **fields}


@dataclass(frozen=True)
class Family:
    """One model family. Subclasses implement `to_hf_config` and `from_hf_config`."""

    name: str
    hf_architecture: str  # e.g. "LlamaForCausalLM"
    hf_model_type: str  # transformers' `model_type`, e.g. "llama"
    presets: Mapping[str, dict]
    mapping: tuple[MappingRule, ...]
    # Model fields every model of the family has (checked on export, written on import).
    fixed_fields: Mapping[str, Any] = field(default_factory=dict)
    # HF tensors that carry no weights (buffers some checkpoints include); skipped on import.
    hf_ignored: tuple[str, ...] = ()

    # ---- HF config both ways -------------------------------------------------------------------------

    def to_hf_config(self, m: Any, vocab: int, *, bos: int | None, eos: int | None, dtype: Any,
                     base: Mapping | None = None) -> Any:
        """A transformers config equivalent to our `ModelConfig` `m` (raises ConversionError if none is).

        `base`: the config.json of the HF model the checkpoint was imported from; its keys that no model field
        decides (token ids, initializer range, keys transformers does not know) are kept (see `hf_config`).
        """
        raise NotImplementedError

    def from_hf_config(self, hf_cfg: Any) -> dict:
        """Our `model.*` fields for a transformers config of this family."""
        raise NotImplementedError

    def config_json(self, hf_cfg: Any) -> dict:
        """config.json content for an exported model (default: transformers' own diff dict)."""
        return hf_cfg.to_diff_dict()

    def export_config_json(self, hf_cfg: Any, original: Mapping | None) -> tuple[dict, list[str]]:
        """config.json for export, and the keys in which it departs from `original` (the imported one).

        When transformers reads `original` as the same configuration as `hf_cfg` (built from our model fields on
        top of `original`), `original` is written back unchanged but for the dtype: every key, spelling and
        value of the released model survives (e.g. a `sliding_window` transformers ignores). Otherwise
        `config_json(hf_cfg)` is written and the differing keys are returned.
        """
        if not original:
            return self.config_json(hf_cfg), []
        if not original.get("architectures"):  # a config saved without a model: naming ours adds, departs from nothing
            original = {**original, "architectures": [self.hf_architecture]}
        ours, theirs = _comparable(hf_cfg), _comparable(type(hf_cfg).from_dict(dict(original)))
        differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if differ:
            return self.config_json(hf_cfg), differ
        out = dict(original)
        dtype = str(hf_cfg.dtype).removeprefix("torch.")
        for key in ("torch_dtype", "dtype"):
            if key in out:
                out[key] = dtype
        if "torch_dtype" not in out:
            out["dtype"] = dtype
        return out, []

    # ---- the mapping of one model ---------------------------------------------------------------------

    def mapping_for(self, m: Any) -> tuple[MappingRule, ...]:
        """The rules for our `ModelConfig` `m` (default: the family's table; families whose checkpoints key
        layers apart expand their templates per layer)."""
        return self.mapping

    def config_for_weights(self, hf_cfg: Any, names: Callable[[], set[str]]) -> tuple[Any, str | None]:
        """The transformers config to import with, given the HF tensor names present (`names()` reads the index), and
        a note when it differs from config.json (default: config.json as it is)."""
        return hf_cfg, None

    def hf_shapes(self, hf_cfg: Any) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the HF checkpoint's tensors (default: what transformers saves for `hf_cfg`)."""
        return hf_parameter_shapes(hf_cfg)

    # ---- helpers for subclasses and the HF bridge -----------------------------------------------------

    def require_fixed_fields(self, m: Any) -> None:
        """Refuse a model whose family-defining fields differ from this family's (naming the field)."""
        require(m, "apply_residual_connection_post_layernorm", False, "a transformers model")
        for key, expected in self.fixed_fields.items():
            require(m, key, expected, self.hf_architecture)

    @staticmethod
    def hf_config(config_class: type, arch: dict, *, bos: int | None, eos: int | None, base: Mapping | None) -> Any:
        """A transformers config: our architecture kwargs `arch`, over the other keys of `base` (an imported
        config.json), over the tokenizer's token ids."""
        kept = {k: v for k, v in (base or {}).items() if k not in _DERIVED_HF_KEYS}
        return config_class(**{"bos_token_id": bos, "eos_token_id": eos, **kept, **arch})

    def ignored_patterns(self) -> list[re.Pattern]:
        return [re.compile(p) for p in self.hf_ignored]

    def matches_hf(self, hf_cfg: Any) -> bool:
        return getattr(hf_cfg, "model_type", None) == self.hf_model_type


# config.json keys that our fields (or transformers) derive: never taken from an imported config.json.
_DERIVED_HF_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "dtype", "torch_dtype", "transformers_version",
                    "_name_or_path", "model_type")


def _comparable(hf_cfg: Any) -> dict:
    """A transformers config as a dict, without the keys that do not describe the model."""
    out = hf_cfg.to_dict()
    for key in ("transformers_version", "dtype", "torch_dtype", "_name_or_path"):
        out.pop(key, None)
    return out


def require(m: Any, key: str, expected: Any, arch: str) -> None:
    value = getattr(m, key)
    if value != expected:
        raise ConversionError(f"model.{key}={value!r} cannot be expressed as {arch} (needs {expected!r})")


def dims(m: Any, vocab: int, padded_vocab: int) -> Dims:
    """The rule sizes of our `ModelConfig` `m`."""
    heads = m.num_attention_heads
    return Dims(
        num_heads=heads,
        num_groups=m.num_query_groups or heads,
        head_dim=m.kv_channels or m.hidden_size // heads,
        hidden=m.hidden_size,
        vocab=vocab,
        padded_vocab=padded_vocab,
        num_experts=m.num_moe_experts or 0,
    )


def hf_parameter_shapes(hf_cfg: Any) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors transformers saves for this config (model built on the meta device).

    These are the checkpoint names `save_pretrained` writes and the Hub uses, which for MoE models are
    per expert (transformers ≥ 5 fuses experts in memory and converts on load and save).
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    shapes = {name: tuple(t.shape) for name, t in revert_weight_conversion(model, model.state_dict()).items()}
    tied = getattr(model, "_tied_weights_keys", None) or {}
    if hf_cfg.tie_word_embeddings:
        for key in (tied if isinstance(tied, (list, dict, tuple, set)) else []):
            shapes.pop(key, None)
        shapes.pop("lm_head.weight", None)
    return shapes
