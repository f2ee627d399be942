"""HF mapping rules: each rule is one class holding both directions (Megatron ↔ transformers).

A family's table is a tuple of rule instances, e.g. `QKV("decoder.layers.self_attention.linear_qkv.weight",
(q, k, v))`. Every rule works on one layer's slice at a time (`to_hf`: Megatron tensor → HF tensors;
`from_hf`: the inverse), so conversions hold one layer of one parameter in memory. Rules run on `meta`
tensors too, which is how shapes are planned before any data is read.

MoE experts: Megatron-Core stores expert weights under `decoder.layers.mlp.experts.experts.*` stacked over
layers and then experts ([layers, experts, ...], global expert indices, whatever the expert-parallel layout);
a rule on such a name works on one (layer, expert) slice and `{e}` in its HF names is the expert index.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, ClassVar

Tensor = Any  # torch.Tensor; torch is imported only where a rule needs its functions


class ConversionError(ValueError):
    """A checkpoint, HF model or config that cannot be converted; the message names the tensor or key."""


@dataclass(frozen=True)
class Dims:
    """The sizes the rules need."""

    num_heads: int
    num_groups: int
    head_dim: int
    hidden: int
    vocab: int  # the true vocabulary (HF side)
    padded_vocab: int  # rows on the Megatron side (TP padding)
    num_experts: int = 0  # MoE experts per layer (0: dense)


EXPERTS_PREFIX = "decoder.layers.mlp.experts.experts."
# A (layer, expert), a layer, an (expert,) of a per-layer expert tensor, or None for an unstacked tensor.
Index = int | tuple[int, int] | tuple[int] | None
# Megatron's per-layer keys (models whose layers differ, e.g. dense-first MoE, and MTP layers): one tensor per
# layer, `decoder.layers.<i>.…` / `mtp.layers.<i>.…`; their experts are stacked on dim 0 alone.
_PER_LAYER = re.compile(r"^(decoder|mtp)\.layers\.\d+\.")


@dataclass(frozen=True)
class MappingRule:
    """One row of a family's table: a Megatron global parameter name and the HF name(s) it becomes.

    Names under `decoder.layers.` are stacked on dim 0 (one slice per layer); `{i}` in an HF name is the
    layer index. Names under `EXPERTS_PREFIX` are stacked on dims 0 and 1 (layer, expert); `{e}` in an HF
    name is the expert index.
    """

    megatron: str
    hf: tuple[str, ...] | str
    op: ClassVar[str] = ""
    keeps_dtype: ClassVar[bool] = False  # export writes the stored dtype, not the requested one

    def __post_init__(self) -> None:
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))

    @property
    def per_layer(self) -> bool:
        """A per-layer key (`decoder.layers.3.…`, `mtp.layers.0.…`): not stacked over layers."""
        return _PER_LAYER.match(self.megatron) is not None

    @property
    def per_layer_experts(self) -> bool:
        return self.per_layer and ".mlp.experts.experts." in self.megatron

    @property
    def stacked(self) -> bool:
        return self.megatron.startswith("decoder.layers.") and not self.per_layer

    @property
    def stack_dims(self) -> int:
        """Leading dims of the Megatron tensor that index slices: 0, 1 (layers, or a per-layer key's experts) or
        2 (layers, experts)."""
        if self.per_layer:
            return 1 if self.per_layer_experts else 0
        if self.megatron.startswith(EXPERTS_PREFIX):
            return 2
        return 1 if self.stacked else 0

    def stack_shape(self, num_layers: int, num_experts: int = 0) -> tuple[int, ...]:
        """The sizes of the stacked leading dims."""
        if self.per_layer_experts:
            return (num_experts,)
        return (num_layers, num_experts)[:self.stack_dims]

    def indices(self, num_layers: int, num_experts: int = 0) -> list[Index]:
        """Every slice of this rule's tensor, in storage order."""
        if self.per_layer_experts:
            return [(e,) for e in range(num_experts)]
        if self.stack_dims == 2:
            return [(i, e) for i in range(num_layers) for e in range(num_experts)]
        return list(range(num_layers)) if self.stack_dims == 1 else [None]

    def storage_slices(self, num_layers: int, num_experts: int = 0) -> tuple[tuple[int, ...], list[Index]]:
        """How Megatron's sharded state stores this tensor: the stacked dims and one index per stored slice (the
        rule's own slices, except for rules that convert several at once)."""
        return self.stack_shape(num_layers, num_experts), self.indices(num_layers, num_experts)

    def hf_names(self, layer: Index) -> list[str]:
        if isinstance(layer, tuple) and len(layer) == 1:
            return [n.format(e=layer[0]) for n in self.hf]
        if isinstance(layer, tuple):
            return [n.format(i=layer[0], e=layer[1]) for n in self.hf]
        return [n.format(i=layer) for n in self.hf]

    def storage_keys(self) -> list[str]:
        """The checkpoint keys this rule's Megatron tensor is stored under (one, but for `SplitRows`)."""
        return [self.megatron]

    def join(self, ts: list[Tensor]) -> Tensor:
        """The Megatron tensor from its stored pieces (`storage_keys` order)."""
        return ts[0]

    def split(self, t: Tensor) -> list[Tensor]:
        """The stored pieces of the Megatron tensor `t` (`storage_keys` order)."""
        return [t]

    def at(self, layer: int, hf_layer: int) -> MappingRule:
        """This template rule for one layer: `{i}` is `layer` in the Megatron key, `hf_layer` in the HF names."""
        return dataclasses.replace(self, megatron=self.megatron.replace("{i}", str(layer)),
                                   hf=tuple(n.replace("{i}", str(hf_layer)) for n in self.hf))

    def to_hf(self, t: Tensor, d: Dims) -> list[Tensor]:
        raise NotImplementedError

    def from_hf(self, ts: list[Tensor], d: Dims) -> Tensor:
        raise NotImplementedError


class Copy(MappingRule):
    """The same tensor on both sides."""

    op = "copy"

    def to_hf(self, t, d):
        return [t]

    def from_hf(self, ts, d):
        return ts[0]


class ExactCopy(Copy):
    """A copy that keeps its stored dtype on export (e.g. DeepSeek's fp32 expert bias in a bf16 export)."""

    op = "copy_exact"
    keeps_dtype: ClassVar[bool] = True


@dataclass(frozen=True)
class Duplicate(MappingRule):
    """An HF tensor that is a stored copy of another one, `same_as` (DeepSeek-V3's MTP layer keeps copies of the
    embedding and the output head, which Megatron ties to the model's own): written on export from the Megatron
    tensor (vocabulary padding removed); on import only checked to equal `same_as`."""

    same_as: str = ""
    op: ClassVar[str] = "duplicate"

    def to_hf(self, t, d):
        return Vocab.to_hf(self, t, d)

    def from_hf(self, ts, d):
        return Vocab.from_hf(self, ts, d)


class Transpose(MappingRule):
    """GPT-2's Conv1D stores weights as [in, out]."""

    op = "transpose"

    def to_hf(self, t, d):
        return [t.t()]

    def from_hf(self, ts, d):
        return ts[0].t()


class Vocab(MappingRule):
    """Rows = vocabulary: TP padding removed on export, zero rows added on import."""

    op = "vocab"

    def to_hf(self, t, d):
        if t.shape[0] < d.vocab:
            raise ConversionError(f"{t.shape[0]} rows < vocabulary {d.vocab}")
        return [t[: d.vocab]]

    def from_hf(self, ts, d):
        import torch

        t = ts[0]
        if t.shape[0] != d.vocab:
            raise ConversionError(f"{t.shape[0]} rows, expected vocab_size {d.vocab}")
        if d.padded_vocab == d.vocab:
            return t
        pad = torch.zeros((d.padded_vocab - d.vocab, *t.shape[1:]), dtype=t.dtype, device=t.device)
        return torch.cat([t, pad], dim=0)


class QKV(MappingRule):
    """Megatron's fused per-query-group [q heads; k; v] rows ↔ separate q, k, v projections (weight or bias)."""

    op = "split_qkv"

    def to_hf(self, t, d):
        qpg = d.num_heads // d.num_groups
        g = t.reshape(d.num_groups, qpg + 2, d.head_dim, -1)
        q = g[:, :qpg].reshape(d.num_heads * d.head_dim, -1)
        k = g[:, qpg].reshape(d.num_groups * d.head_dim, -1)
        v = g[:, qpg + 1].reshape(d.num_groups * d.head_dim, -1)
        if t.dim() == 1:
            return [q.reshape(-1), k.reshape(-1), v.reshape(-1)]
        return [q, k, v]

    def from_hf(self, ts, d):
        import torch

        q, k, v = ts
        qpg = d.num_heads // d.num_groups
        tail = q.shape[1:]
        parts = [
            q.reshape(d.num_groups, qpg, d.head_dim, *tail),
            k.reshape(d.num_groups, 1, d.head_dim, *tail),
            v.reshape(d.num_groups, 1, d.head_dim, *tail),
        ]
        return torch.cat(parts, dim=1).reshape(-1, *tail)


class GateUp(MappingRule):
    """Gated fc1 = [gate; up] ↔ gate_proj, up_proj."""

    op = "split_gate_up"

    def to_hf(self, t, d):
        if t.shape[0] % 2:
            raise ConversionError(f"gated fc1 has an odd number of rows ({t.shape[0]})")
        return list(t.chunk(2, dim=0))

    def from_hf(self, ts, d):
        import torch

        return torch.cat(ts, dim=0)


class FusedQKV(MappingRule):
    """Megatron's per-head [q; k; v] rows ↔ GPT-2's Conv1D c_attn [in, q_all | k_all | v_all]."""

    op = "fused_qkv"

    def to_hf(self, t, d):
        g = t.reshape(d.num_heads, 3, d.head_dim, -1)
        return [g.permute(1, 0, 2, 3).reshape(3 * d.num_heads * d.head_dim, -1).t()]

    def from_hf(self, ts, d):
        w = ts[0].t().reshape(3, d.num_heads, d.head_dim, -1)
        return w.permute(1, 0, 2, 3).reshape(3 * d.num_heads * d.head_dim, -1)


class FusedQKVBias(MappingRule):
    """The bias of `FusedQKV`: per-head [q; k; v] ↔ [q_all | k_all | v_all]."""

    op = "fused_qkv_bias"

    def to_hf(self, t, d):
        return [t.reshape(d.num_heads, 3, d.head_dim).permute(1, 0, 2).reshape(-1)]

    def from_hf(self, ts, d):
        return ts[0].reshape(3, d.num_heads, d.head_dim).permute(1, 0, 2).reshape(-1)


class LayerExperts(MappingRule):
    """An expert tensor (under `EXPERTS_PREFIX`, [layers, experts, ...]) whose HF side holds every expert of a layer
    in one tensor, [experts, ...] (GPT-OSS): converted one layer at a time, all experts together; Megatron still
    stores one slice per (layer, expert) (`storage_slices`)."""

    op = "layer_experts"

    @property
    def stack_dims(self) -> int:
        return 1

    def stack_shape(self, num_layers: int, num_experts: int = 0) -> tuple[int, ...]:
        return (num_layers,)

    def indices(self, num_layers: int, num_experts: int = 0) -> list[Index]:
        return list(range(num_layers))

    def storage_slices(self, num_layers: int, num_experts: int = 0) -> tuple[tuple[int, ...], list[Index]]:
        return (num_layers, num_experts), [(i, e) for i in range(num_layers) for e in range(num_experts)]

    def to_hf(self, t, d):
        return [t]

    def from_hf(self, ts, d):
        return ts[0]


class LayerExpertsTransposed(LayerExperts):
    """Megatron's [experts, out, in] ↔ HF's [experts, in, out] (GPT-OSS's `down_proj`)."""

    op = "layer_experts_transpose"

    def to_hf(self, t, d):
        return [t.transpose(1, 2)]

    def from_hf(self, ts, d):
        return ts[0].transpose(1, 2)


class LayerExpertsGateUp(LayerExperts):
    """Megatron's gated fc1, [gate; up] rows per expert, ↔ HF's fused `gate_up_proj` with gate and up interleaved
    (gate at even, up at odd positions): the weight [experts, 2·ffn, hidden] ↔ [experts, hidden, 2·ffn]
    (transposed), the bias [experts, 2·ffn] ↔ [experts, 2·ffn]."""

    op = "layer_experts_gate_up"

    def to_hf(self, t, d):
        experts, rows, *rest = t.shape
        if rows % 2:
            raise ConversionError(f"gated fc1 has an odd number of rows ({rows})")
        out = t.reshape(experts, 2, rows // 2, *rest).transpose(1, 2).reshape(experts, rows, *rest)
        return [out.transpose(1, 2) if rest else out]

    def from_hf(self, ts, d):
        t = ts[0].transpose(1, 2) if ts[0].dim() == 3 else ts[0]
        experts, rows, *rest = t.shape
        if rows % 2:
            raise ConversionError(f"fused gate_up has an odd number of columns ({rows})")
        return t.reshape(experts, rows // 2, 2, *rest).transpose(1, 2).reshape(experts, rows, *rest)


@dataclass(frozen=True)
class SplitRows(Copy):
    """A tensor Megatron-Core's sharded state stores as several keys, `megatron` + "." + each part's name, one per
    block of rows (`parts`: (name, rows) in order; each part split over TP on its own): Mamba's fused in-projection
    (z, x, B, C, dt) and convolution (x, B, C). The HF side is the whole tensor, rows in the same order."""

    parts: tuple[tuple[str, int], ...] = ()
    op: ClassVar[str] = "split_rows"

    def storage_keys(self) -> list[str]:
        return [f"{self.megatron}.{name}" for name, _ in self.parts]

    def join(self, ts):
        import torch

        if [t.shape[0] for t in ts] != [rows for _, rows in self.parts]:
            raise ConversionError(f"'{self.megatron}' parts have {[t.shape[0] for t in ts]} rows, expected "
                                  f"{[rows for _, rows in self.parts]}")
        return torch.cat(ts, dim=0)

    def split(self, t):
        return list(t.split([rows for _, rows in self.parts], dim=0))


RULES: dict[str, type[MappingRule]] = {
    cls.op: cls for cls in (Copy, Transpose, Vocab, QKV, GateUp, FusedQKV, FusedQKVBias, ExactCopy, Duplicate,
                            LayerExperts, LayerExpertsTransposed, LayerExpertsGateUp, SplitRows)
}
