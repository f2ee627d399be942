"""Gated DeltaNet layers (Qwen3-Next's linear attention) on Megatron-Core's `GatedDeltaNet`, mixed with full attention.

Which layers are linear: Megatron-Core's `linear_attention_freq` (`experimental_attention_variant="gated_delta_net"`):
an int N makes every N-th layer (N, 2N, ...) full attention and the others Gated DeltaNet (Qwen's
`full_attention_interval`), a list gives 1 (linear) / 0 (full) per layer (`linear_pattern`). Megatron-Core's own block
builder (`get_transformer_block_with_experimental_attention_variant_spec`) takes only Transformer Engine; here each
decoder layer's spec is the model's usual spec (`specs.py`) with its attention swapped for Gated DeltaNet
(`use_linear_attention`), so MoE / dense MLPs, pipeline stages and MTP stay the usual ones.

The module: Megatron-Core's `GatedDeltaNet` where flash-linear-attention is installed (GPU); else `TorchGatedDeltaNet`,
the same module (its parameters, names, tensor-parallel split and sharded checkpoint layout: `in_proj` split into
query, key, value, z, beta, alpha; `conv1d` into query, key, value) with a forward of plain torch pieces:
`causal_conv1d.causal_conv1d`, `gated_delta_rule.gated_delta_rule` (Megatron-Core's `torch_chunk_gated_delta_rule`
per document), FLA's l2norm, Megatron-Core's gated output norm (`_apply_gated_norm` over `norms.HeadNorm`). Packed
documents (THD `PackedSeqParams`) reset the convolution and the recurrent state at each boundary. No context
parallelism (refused by validation: `pretrain/rules/linear_attention.py`).

On the local spec the layer's input norm is separate (`input_layernorm`) and stored under Transformer Engine's key
`self_attention.in_proj.layer_norm_weight` (TE fuses it into `in_proj`), so checkpoints move between CPU and GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from model_providers.core.causal_conv1d import causal_conv1d
from model_providers.core.gated_delta_rule import document_bounds, gated_delta_rule, l2norm, seq_index
from model_providers.core.linear_layers import has_linear_attention, linear_pattern
from model_providers.core.norms import HeadNorm


def fla_available() -> bool:
    """flash-linear-attention importable (Megatron-Core's GatedDeltaNet refuses to build without it)."""
    return bool(importlib.import_module(GatedDeltaNet.__init__.__module__).HAVE_FLA)


@contextlib.contextmanager
def _fla_check_passed():
    """Megatron-Core's `GatedDeltaNet.__init__` raises ImportError without FLA although building the module needs none
    of it; `TorchGatedDeltaNet` builds it with the flag set and never calls FLA."""
    module = importlib.import_module(GatedDeltaNet.__init__.__module__)
    saved = module.HAVE_FLA
    module.HAVE_FLA = True
    try:
        yield
    finally:
        module.HAVE_FLA = saved


class TorchGatedDeltaNet(GatedDeltaNet):
    """Megatron-Core's `GatedDeltaNet` with a plain-torch forward (see the module doc); used where FLA is absent."""

    def __init__(self, *args, **kwargs):
        with _fla_check_passed():
            super().__init__(*args, **kwargs)
        # 0.16.1 marks these tensor-parallel without a split dim (0.19 adds partition_dim 0): the heads / channels.
        for param in (self.conv1d.weight, self.conv1d.bias, self.A_log, self.dt_bias):
            if param is not None and not hasattr(param, "partition_dim"):
                param.partition_dim, param.partition_stride = 0, 1

    def _setup_variant_attrs(self):  # 0.19+: the kernel it would pick is FLA's (None here)
        super()._setup_variant_attrs()
        self.gated_delta_rule = gated_delta_rule

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *args, packed_seq_params=None, **kwargs):
        """[s, b, h] (a sequence-parallel slice under SP) → (output [s, b, h], bias)."""
        tp = self.tp_size
        qk_local, v_local, heads = self.qk_dim // tp, self.v_dim // tp, self.num_value_heads // tp
        qkvzba, _ = self.in_proj(hidden_states)  # the whole sequence, this rank's heads
        seq_len, batch = qkvzba.shape[:2]
        qkvzba = qkvzba.transpose(0, 1)
        qkv, gate, beta, alpha = torch.split(qkvzba, [2 * qk_local + v_local, v_local, heads, heads], dim=-1)
        bounds = document_bounds(packed_seq_params, seq_len)
        conv_bias = self.conv1d.bias if self.conv_bias else None
        qkv = causal_conv1d(qkv.transpose(1, 2), self.conv1d.weight.squeeze(1), conv_bias, self.activation,
                            seq_index(bounds, seq_len, qkv.device)).transpose(1, 2)
        query, key, value = torch.split(qkv, [qk_local, qk_local, v_local], dim=-1)
        query = query.reshape(batch, seq_len, -1, self.key_head_dim)
        key = key.reshape(batch, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        if self.use_qk_l2norm:
            query, key = l2norm(query), l2norm(key)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:
            query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
        g = -self.A_log.exp() * F.softplus(alpha.float() + self.dt_bias)
        core = gated_delta_rule(query, key, value, g, beta.sigmoid(), bounds)
        # Megatron-Core's `_apply_gated_norm` (not called: torch.compile'd where the CPU shims are not applied).
        normed = self.out_norm(core.reshape(-1, self.value_head_dim))
        out = (normed * self.act_fn(gate.reshape(-1, self.value_head_dim).float())).to(core.dtype)
        out = out.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()
        return self.out_proj(out)


def gdn_module() -> type:
    """The Gated DeltaNet class this machine runs: Megatron-Core's with FLA, else `TorchGatedDeltaNet`."""
    return GatedDeltaNet if fla_available() else TorchGatedDeltaNet


def _gdn_spec(config, use_te: bool) -> ModuleSpec:
    """The Gated DeltaNet attention spec: TE's fused norm + in_proj, TE norm, TE row-parallel out_proj (Megatron-Core's
    `get_gated_delta_net_module_spec`), or the local linears and `HeadNorm`."""
    if use_te:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_gated_delta_net_module_spec,
        )

        spec = get_gated_delta_net_module_spec(config)
        return dataclasses.replace(spec, module=gdn_module())
    return ModuleSpec(module=TorchGatedDeltaNet, metainfo={"fuse_input_layernorm": False},
                      submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=HeadNorm,
                                                         out_proj=RowParallelLinear))


def use_linear_attention(config, layer: ModuleSpec, use_te: bool) -> ModuleSpec:
    """`layer` (a decoder layer spec of the model's usual kind) with Gated DeltaNet in place of its self-attention."""
    sub = dataclasses.replace(layer.submodules, self_attention=_gdn_spec(config, use_te))
    keys = {k: v for k, v in sub.sharded_state_dict_keys_map.items() if k != "input_layernorm."}
    if use_te:
        sub.input_layernorm = IdentityOp  # fused into in_proj
    else:
        keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
    sub.sharded_state_dict_keys_map = keys
    return dataclasses.replace(layer, submodules=sub)


def apply_pattern(config, layers: list[ModuleSpec], offset: int, use_te: bool) -> list[ModuleSpec]:
    """The layer specs of one pipeline stage (global layers offset, offset+1, ...) with Gated DeltaNet on the linear
    layers, unchanged without `experimental_attention_variant`."""
    if not has_linear_attention(config):
        return layers
    pattern = linear_pattern(config.num_layers, config.linear_attention_freq)
    return [use_linear_attention(config, spec, use_te) if pattern[offset + i] else spec
            for i, spec in enumerate(layers)]


def stored_parts(model: torch.nn.Module) -> dict[str, tuple[list[tuple[str, int]], int]]:
    """{parameter name: ([(part, global rows), ...], TP size)} of every tensor Megatron-Core's GatedDeltaNet stores in
    parts in torch_dist (its `sharded_state_dict`: in_proj as query, key, value, z, beta, alpha; conv1d as query,
    key, value; each part split over TP on its own). Read by the fsdp_dtensor format
    (`pretrain/checkpoint/parts.py`)."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, GatedDeltaNet):
            continue
        tp, qk, v = module.tp_size, module.qk_dim, module.v_dim
        if hasattr(module, "in_proj_split_sections"):  # 0.19+: the module names its own split
            in_proj = [(n, rows * tp) for n, rows in zip(module.in_proj_split_names, module.in_proj_split_sections)]
        else:
            heads = module.num_value_heads
            in_proj = list(zip(("query", "key", "value", "z", "beta", "alpha"), (qk, qk, v, v, heads, heads)))
        conv = [("query", qk), ("key", qk), ("value", v)]
        prefix = f"{name}." if name else ""
        out[f"{prefix}in_proj.weight"] = (in_proj, tp)
        out[f"{prefix}conv1d.weight"] = (conv, tp)
        if module.conv_bias:
            out[f"{prefix}conv1d.bias"] = (conv, tp)
    return out


# --------------------------------------------------------------------------------------------------
# Layout-invariant initialisation (model_providers/core/builder.py): the values, and the parts split over TP
# --------------------------------------------------------------------------------------------------

def _is(gname: str, *names: str) -> bool:
    return gname.endswith(tuple(f"self_attention.{n}" for n in names))


def tp_parts(gname: str, m) -> list[int] | None:
    """The full sizes of the parts a Gated DeltaNet tensor is split by over TP, part by part (Megatron-Core's sharded
    layout: in_proj [q; k; v; z; beta; alpha], conv1d [q; k; v]); None for the others."""
    qk, v = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    if _is(gname, "in_proj.weight"):
        return [qk, qk, v, v, m.linear_num_value_heads, m.linear_num_value_heads]
    if _is(gname, "conv1d.weight", "conv1d.bias"):
        return [qk, qk, v]
    return None


def initial_value(gname: str, shape: list[int], gen: torch.Generator, m, device) -> torch.Tensor | None:
    """The full-shape initial value of a Gated DeltaNet parameter other than its matrices (None for the others, which
    take the generic N(0, std): in_proj, out_proj as an output projection): conv1d ~ U(±1/√width) (torch's Conv1d
    default, as Megatron-Core leaves it); A_log = log U(1, 16) (Megatron-Core's A_init_range); dt_bias 1; the output
    norm 1 (0 when zero-centred)."""
    if _is(gname, "conv1d.weight"):
        bound = 1.0 / math.sqrt(m.linear_conv_kernel_dim)
        return torch.empty(shape, device=device).uniform_(-bound, bound, generator=gen)
    if _is(gname, "A_log"):
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log_()
    if _is(gname, "dt_bias"):
        return torch.ones(shape, device=device)
    if _is(gname, "out_norm.weight"):
        return torch.full(shape, 0.0 if m.layernorm_zero_centered_gamma else 1.0, device=device)
    return None
