"""YaRN RoPE from an HF `rope_scaling` / `rope_parameters` dict: the checks and fields shared by the families that
carry it (DeepSeek-V3 / Kimi K2 on MLA, GPT-OSS); ConversionError names what Megatron-Core's YaRN cannot compute."""

from __future__ import annotations

import math
from typing import Any

from model_providers.core.mapping import ConversionError


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """transformers' YaRN concentration factor: get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)."""
    def get(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    return get(factor, mscale) / get(factor, mscale_all_dim)


def yarn_fields(hf: Any, rope: dict, keep_mscale_all_dim: bool) -> dict:
    """Our YaRN fields of an HF config's YaRN rope dict. Without both mscale and mscale_all_dim transformers scales
    cos/sin by get_mscale(factor) alone (mscale 1, mscale_all_dim 0 here); `keep_mscale_all_dim` keeps a lone
    mscale_all_dim (DeepSeek's attention also scales the softmax by it)."""
    factor = rope.get("factor") or hf.max_position_embeddings / rope["original_max_position_embeddings"]
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        if (mscale or 1.0) != 1.0:
            raise ConversionError(f"config.json: rope_scaling.mscale={mscale} without mscale_all_dim is not "
                                  "supported (transformers ignores it, Megatron-Core would not)")
        mscale, mscale_all_dim = 1.0, float(mscale_all_dim or 0.0) if keep_mscale_all_dim else 0.0
    attention = rope.get("attention_factor")
    if attention is not None and not math.isclose(attention, yarn_attention_factor(factor, mscale, mscale_all_dim)):
        raise ConversionError(f"config.json: rope_scaling.attention_factor={attention} is not supported (Megatron-Core "
                              "derives it from factor, mscale and mscale_all_dim)")
    return {"rotary_scaling_factor": float(factor),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope.get("beta_fast") or 32.0), "beta_slow": float(rope.get("beta_slow") or 1.0),
            "mscale": float(mscale), "mscale_all_dim": float(mscale_all_dim)}


def refuse(hf: Any, key: str, ok: bool, why: str) -> None:
    """ConversionError naming an HF config field whose value we cannot express."""
    if not ok:
        raise ConversionError(f"config.json: {key}={getattr(hf, key, None)!r} is not supported ({why})")
