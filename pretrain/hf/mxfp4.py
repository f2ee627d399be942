"""MXFP4 weights (the OCP Microscaling format, as openai/gpt-oss checkpoints store their experts) read as plain
tensors on import.

An MXFP4 tensor `X` is stored as two: `X_blocks`, uint8 `[*lead, rows, groups, 16]`, each byte two FP4 E2M1 values
(element 2k in the low nibble, 2k + 1 in the high one), and `X_scales`, uint8 `[*lead, rows, groups]`, one E8M0
power of two per 32 values (2^(s − 127); 255 is NaN). A value is `E2M1[nibble] × 2^(s − 127)`. Every such value has
at most two significant bits, so it is exact in bf16 and fp32 alike (scales ≥ 253, whose largest values overflow
them, and the NaN code are refused, naming the tensor).

GPT-OSS stores each expert weight as Megatron does, `[out, in]` (`rows` = out, `groups × 32` = in); transformers'
`GptOssExperts` holds `[in, out]`, so the tensor a reader returns is the dequantized one with its last two dims
swapped: `model.layers.{i}.mlp.experts.gate_up_proj` `[experts, hidden, 2 × ffn]` from `gate_up_proj_blocks`
`[experts, 2 × ffn, hidden / 32, 16]`.
"""

from __future__ import annotations

from typing import Any

import torch

from model_providers.core.mapping import ConversionError

# FP4 E2M1 (1 sign, 2 exponent, 1 mantissa bit), by code 0..15.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127  # E8M0: 2^(s - 127)
SCALE_NAN = 255
_CHUNK_VALUES = 1 << 24  # values dequantized at a time (bounds the index and fp32 temporaries)
BLOCKS, SCALES = "_blocks", "_scales"


def _byte_table() -> torch.Tensor:
    """[256, 2] fp32: the two values of each byte (low nibble first)."""
    codes = torch.arange(256)
    lut = torch.tensor(E2M1, dtype=torch.float32)
    return torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=1)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`[*lead, groups, 16]` uint8 blocks and `[*lead, groups]` uint8 scales → `[*lead, groups × 32]` of `dtype`.

    Works on 16 M values at a time (a 120B expert layer is 2 G values)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ConversionError(f"MXFP4 blocks and scales must be uint8 (found {blocks.dtype}, {scales.dtype})")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ConversionError(f"MXFP4 blocks {list(blocks.shape)} do not fit scales {list(scales.shape)} (blocks "
                              f"[..., groups, {BLOCK // 2}], scales [..., groups])")
    if bool((scales == SCALE_NAN).any()):
        raise ConversionError(f"MXFP4 scales hold the E8M0 NaN code {SCALE_NAN}")
    table = _byte_table()
    lead = blocks.shape[:-1]
    flat_blocks = blocks.reshape(-1, BLOCK // 2)  # one row per group of 32 values
    flat_scales = scales.reshape(-1, 1).to(torch.int32) - SCALE_BIAS
    out = torch.empty(flat_blocks.shape[0], BLOCK, dtype=dtype)
    step = max(1, _CHUNK_VALUES // BLOCK)
    for r in range(0, flat_blocks.shape[0], step):
        values = table[flat_blocks[r:r + step].long()].reshape(-1, BLOCK)  # [groups, 32] fp32
        chunk = torch.ldexp(values, flat_scales[r:r + step])
        if not bool(torch.isfinite(chunk).all()):
            raise ConversionError(f"MXFP4 scale {int(flat_scales[r:r + step].max()) + SCALE_BIAS} overflows fp32")
        out[r:r + step] = chunk.to(dtype)
    return out.reshape(*lead[:-1], -1)


def mxfp4_pairs(names: set[str] | dict) -> dict[str, tuple[str, str]]:
    """The MXFP4 tensors among `names`: the tensor's name → (its `_blocks`, its `_scales` name). A `_blocks` tensor
    without its `_scales` (or the reverse) is refused, naming it."""
    pairs = {}
    for name in names:
        for own, other in ((BLOCKS, SCALES), (SCALES, BLOCKS)):
            if name.endswith(own):
                base = name[: -len(own)]
                if base + other not in names:
                    raise ConversionError(f"HF tensor '{name}' (MXFP4) has no '{base + other}'")
                pairs[base] = (base + BLOCKS, base + SCALES)
    return pairs


class DequantizingReader:
    """An `HFReader` whose MXFP4 pairs read as the dequantized tensor (last two dims swapped, as transformers holds
    GPT-OSS's experts), in `dtype`; every other tensor reads as stored. Same interface: `info`, `weight_map`,
    `read`."""

    def __init__(self, reader: Any, pairs: dict[str, tuple[str, str]], dtype: torch.dtype):
        self.inner, self.pairs, self.dtype = reader, pairs, dtype
        self.dir = reader.dir
        hidden = {n for pair in pairs.values() for n in pair}
        self.info = {k: v for k, v in reader.info.items() if k not in hidden}
        self.weight_map = {k: v for k, v in reader.weight_map.items() if k not in hidden}
        for name, (blocks, scales) in pairs.items():
            b_shape, b_dtype = reader.info[blocks]
            s_shape, s_dtype = reader.info[scales]
            if b_dtype != torch.uint8 or s_dtype != torch.uint8 or len(b_shape) < 3 or b_shape[-1] != BLOCK // 2 \
                    or tuple(b_shape[:-1]) != tuple(s_shape):
                raise ConversionError(f"HF tensors '{blocks}' {list(b_shape)} {b_dtype} and '{scales}' "
                                      f"{list(s_shape)} {s_dtype} are not MXFP4 (uint8 [..., rows, groups, 16] and "
                                      "[..., rows, groups])")
            *lead, rows, groups, _ = b_shape
            self.info[name] = ((*lead, groups * BLOCK, rows), dtype)
            self.weight_map[name] = reader.weight_map[blocks]

    def read(self, name: str) -> torch.Tensor:
        if name not in self.pairs:
            return self.inner.read(name)
        blocks, scales = self.pairs[name]
        try:
            values = dequantize(self.inner.read(blocks), self.inner.read(scales), self.dtype)
        except ConversionError as exc:
            raise ConversionError(f"HF tensor '{blocks}': {exc}") from None
        return values.transpose(-1, -2)  # a view: the mapping rule transposes it back without a copy


def dequantizing(reader: Any, config_tree: dict, dtype: torch.dtype | None) -> tuple[Any, dict | None]:
    """`reader` itself, or a `DequantizingReader` over it when the model holds MXFP4 tensors, and the record of what
    was dequantized (None: nothing). `dtype`: the one asked for (--dtype), else that of the model's unquantized
    floating-point tensors (bf16 in openai/gpt-oss), else bf16.

    config.json's `quantization_config` must name MXFP4 when present: another method is refused, naming it."""
    quant = config_tree.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if quant is not None and method != "mxfp4":
        raise ConversionError(f"config.json: quantization_config.quant_method={method!r} is not supported (MXFP4 "
                              "expert weights are dequantized on import; nothing else is)")
    pairs = mxfp4_pairs(reader.info)
    if not pairs:
        if quant is not None:
            raise ConversionError("config.json: quantization_config names MXFP4 but no tensor is stored as "
                                  "*_blocks/*_scales")
        return reader, None
    if dtype is None:
        hidden = {n for pair in pairs.values() for n in pair}
        stored = {dt for name, (_, dt) in reader.info.items() if name not in hidden and dt.is_floating_point}
        dtype = stored.pop() if len(stored) == 1 else torch.bfloat16
    names = sorted(pairs)
    record = {"format": "mxfp4", "dtype": str(dtype).removeprefix("torch."), "tensors": len(names),
              "names": names, "quantization_config": quant}
    return DequantizingReader(reader, pairs, dtype), record


def note(record: dict) -> str:
    """The one line from-hf prints about a dequantization."""
    first = record["names"][0]
    pattern = ".".join("*" if part.isdigit() else part for part in first.split("."))
    kinds = sorted({n.rsplit(".", 1)[-1] for n in record["names"]})
    where = pattern.rsplit(".", 1)[0]
    exact = "exact: bf16 and fp32 hold every MXFP4 value" if record["dtype"] in ("bfloat16", "float32") else \
        "rounded: only bf16 and fp32 hold every MXFP4 value exactly"
    return (f"{record['tensors']} MXFP4 tensors ({where}.{{{','.join(kinds)}}}, stored as *_blocks/*_scales) "
            f"dequantized to {record['dtype']} ({exact}); the checkpoint holds them unquantized (recorded in "
            "hf_import.json)")
