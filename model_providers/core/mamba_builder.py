"""Building Megatron-Core's `MambaModel` (hybrid Mamba-2 / attention / MLP / MoE layers, `model.hybrid_layer_pattern`)
for `builder.build_model`, and the Mamba mixer's part of the layout-invariant initialisation.

Specs. With Transformer Engine: Megatron-Core's own hybrid stack spec (its mixer where the `mamba_ssm` kernels are
installed, `CpuMambaMixer` where not). Without (CPU): the same stack from the local pieces, each layer's norm a
separate `SequenceParallelNorm` stored under the TE spec's fused key (`mixer.in_proj.layer_norm_weight`,
`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`; an MoE layer keeps
`pre_mlp_layernorm`), so checkpoints move between CPU and GPU; attention, MLP and MoE are the GPT local spec's
(`specs._local_layer_spec`: CP / packed-document attention, sequence-parallel norms, local experts); the mixer is
`CpuMambaMixer` (`model_providers/core/mamba_mixer.py`). The stack's final norm is built the same way
(`LocalMambaStack`: Megatron-Core's stack makes a TE norm).

Releases: 0.16.1–0.18 build `MambaModel(mamba_stack_spec=..., hybrid_override_pattern=...)` and split pipeline
stages inside the stack (even or uneven stages; no virtual pipeline; no MTP); 0.19+ build `HybridModel` through
the same class (`hybrid_layer_pattern`, `vp_stage`) with the unified pattern: our placement written as `|` segment
boundaries (`segments`) and the MTP depths as `/` patterns, the MTP block in the stack spec (`mtp_block_spec`; the
local one: `local_mtp_block_spec`). Found from the installed classes.
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.mamba import MambaModel
from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from model_providers.core import hybrid
from model_providers.core.knobs import HYBRID, HYBRID_MODEL, MIXER, mcore_kwargs
from model_providers.core.mamba_mixer import CpuMambaMixer, mamba_kernels_available
from model_providers.core.specs import SequenceParallelNorm, _local_layer_spec


def hybrid_fields(m: Any, layout: Any) -> dict:
    """The TransformerConfig fields of a hybrid model: those declared `mcore=HYBRID` (`pretrain/sections/model.py`),
    the Mamba heads defaulted (`hybrid.mamba_num_heads`), and the hybrid flag (the scaled init's layer count). Where
    the pattern carries the pipeline segments (0.19+, `segments`), no first / last stage sizes: `HybridModel` refuses
    both (the segments say them)."""
    fields = dict(mcore_kwargs(m, HYBRID), mamba_num_heads=hybrid.mamba_num_heads(m), is_hybrid_model=True)
    if segments(m, layout) is not None:
        fields.update(num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None)
    return fields


def segments(m: Any, layout: Any) -> list[str] | None:
    """The decoder pattern's pipeline segments, one per model chunk in Megatron-Core's order (virtual stage by
    virtual stage, pipeline rank by rank), each chunk's layers as our placement gives them (`Layout.chunk_layers`:
    even split, first / last stage layers, embedding / loss in the split, `parallel.pipeline_layout`); None on one
    stage or before 0.19 (`MambaStack` splits the stages itself there)."""
    if not _new_release() or layout.pp * layout.vp == 1:
        return None
    pattern, out = m.hybrid_layer_pattern, []
    for v in range(layout.vp):
        for r in range(layout.pp):
            offset, count = layout.chunk_layers(m.num_layers, r, v)
            out.append(pattern[offset:offset + count])
    return out


def _mixer_params(m: Any) -> dict:
    """`MambaMixer`'s constructor arguments our model fields set (declared `mcore=MIXER`; its other defaults are
    Nemotron-H's)."""
    return mcore_kwargs(m, MIXER)


def model_fields(m: Any, layout: Any, stage: int | None, rotary_base: int | float) -> dict:
    """`MambaModel`'s own arguments: the fields declared `mcore=HYBRID_MODEL` under this release's names (the pattern
    is `hybrid_override_pattern` on 0.16.1-0.18, which take no `vp_stage`), the context length defaulted to the
    training length and RoPE's base as the builder types it. On 0.19+ the pattern is the unified one: the pipeline
    segments (`segments`) and the MTP depths (`hybrid.unified_pattern`)."""
    kwargs = {release_name(k): v for k, v in mcore_kwargs(m, HYBRID_MODEL).items()}
    kwargs.update(rotary_base=rotary_base, max_sequence_length=m.max_position_embeddings or m.seq_length)
    if not _new_release():
        return kwargs
    return dict(kwargs, hybrid_layer_pattern=hybrid.unified_pattern(m, segments(m, layout)), vp_stage=stage)


def release_name(arg: str) -> str:
    """A `MambaModel` argument under the installed release's name (0.19's `hybrid_layer_pattern` was
    `hybrid_override_pattern` before)."""
    return "hybrid_override_pattern" if arg == "hybrid_layer_pattern" and not _new_release() else arg


class LocalMambaStack(MambaStack):
    """Megatron-Core's Mamba stack whose final norm is a `SequenceParallelNorm` (its own is a TE norm)."""

    def __init__(self, config, submodules, *args, **kwargs):
        kwargs["post_layer_norm"] = False
        super().__init__(config, submodules, *args, **kwargs)
        self.post_layer_norm = True
        if self.post_process:
            self.final_norm = SequenceParallelNorm(config, config.hidden_size, eps=config.layernorm_epsilon)


class MambaLayerNorm:
    """A Mamba layer's norm: `SequenceParallelNorm` with the model's epsilon (0.16.1–0.18 build it from the config
    and hidden size alone, 0.19+ pass the epsilon too)."""

    def __new__(cls, config, hidden_size: int, eps: float | None = None, **_unused):
        return SequenceParallelNorm(config, hidden_size, eps=config.layernorm_epsilon if eps is None else eps)


def local_stack_spec(config, m: Any, packed_sequences: bool) -> ModuleSpec:
    """The hybrid stack on Megatron-Core's local pieces and the CPU mixer (module docstring)."""
    dense = _local_layer_spec(config, None, packed_sequences).submodules
    bda = get_bias_dropout_add
    mixer = ModuleSpec(module=CpuMambaMixer, params=_mixer_params(m),
                       submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
    layers = dict(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
            norm=MambaLayerNorm, mixer=mixer, mamba_bda=bda,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"})),
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=SequenceParallelNorm, self_attention=dense.self_attention, self_attn_bda=bda,
            sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"})),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=SequenceParallelNorm, mlp=dense.mlp, mlp_bda=bda,
            sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"})),
    )
    if config.num_moe_experts:
        moe = _local_layer_spec(config, config.num_moe_experts, packed_sequences).submodules
        layers["moe_layer"] = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=SequenceParallelNorm, mlp=moe.mlp, mlp_bda=bda))
    if hybrid.mtp_pattern(m):
        layers["mtp_block_spec"] = local_mtp_block_spec()
    return ModuleSpec(module=LocalMambaStack, submodules=MambaStackSubmodules(**layers))


def local_mtp_block_spec() -> ModuleSpec:
    """Megatron-Core 0.19's hybrid MTP block on the local pieces: per depth the embedding and hidden norms, the
    column-parallel 2h → h projection of their concatenation and a final norm (norms that support sequence
    parallelism); the depth's layers are built by `MultiTokenPredictionLayer` from the stack's own layer specs and
    `model.mtp_layer_pattern` (as Megatron-Core's TE spec `_hybrid_mtp_block_spec` does)."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )

    layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=SequenceParallelNorm, hnorm=SequenceParallelNorm, eh_proj=ColumnParallelLinear, mtp_model_layer=None,
        layer_norm=SequenceParallelNorm))
    return ModuleSpec(module=MultiTokenPredictionBlock,
                      submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer]))


def te_stack_spec(m: Any) -> ModuleSpec:
    """Megatron-Core's own hybrid stack spec (Transformer Engine), with our mixer arguments; the CPU mixer where
    the `mamba_ssm` kernels are not installed."""
    try:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as spec
    except ImportError:  # 0.16.1-0.18
        from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec as spec
    # Copies along the path to the mixer only (the spec's other entries hold closures deepcopy cannot copy).
    spec, stack = copy.copy(spec), copy.copy(spec.submodules)
    layer = copy.copy(stack.mamba_layer)
    layer_subs = copy.copy(layer.submodules)
    mixer = copy.copy(layer_subs.mixer)
    mixer.params = {**mixer.params, **_mixer_params(m)}
    if not mamba_kernels_available():
        mixer.module = CpuMambaMixer
    layer_subs.mixer, layer.submodules, stack.mamba_layer, spec.submodules = mixer, layer_subs, layer, stack
    return spec


def _new_release() -> bool:
    """0.19+: `MambaModel` is the deprecated name of `HybridModel` (pattern `hybrid_layer_pattern`, `vp_stage`)."""
    return "hybrid_override_pattern" not in inspect.signature(MambaModel.__init__).parameters


def hybrid_model(config, plan: Any, layout: Any, stage: int | None, pre: bool, post: bool, rotary_base) -> MambaModel:
    """One `MambaModel` chunk of this rank (`stage`: the virtual pipeline stage, None without interleaving)."""
    m = plan.config
    spec = te_stack_spec(m) if layout.use_te else local_stack_spec(config, m, plan.packed_documents)
    return MambaModel(config=config, mamba_stack_spec=spec, vocab_size=layout.padded_vocab, pre_process=pre,
                      post_process=post, **model_fields(m, layout, stage, rotary_base))


# --------------------------------------------------------------------------------------------------
# The mixer's part of the layout-invariant initialisation (builder.initialize_layout_invariant)
# --------------------------------------------------------------------------------------------------

def _is(gname: str, *suffixes: str) -> bool:
    return any(gname.endswith(".mixer." + s) for s in suffixes)


def initial_value(gname: str, shape: list[int], gen: torch.Generator, m: Any, device) -> torch.Tensor | None:
    """The full-shape initial value of a hybrid model's own parameter (Megatron-Core's `MambaMixer` rules), None for
    the others: A = -exp(A_log) with A ~ U[1, 16]; dt_bias = softplus⁻¹(dt), dt log-uniform in [dt_min, dt_max] and
    at least dt_init_floor; D = 1; conv weights ~ U(±1/√width); norm weights 1."""
    if _is(gname, "A_log"):
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log()
    if _is(gname, "dt_bias"):
        lo, hi = math.log(m.mamba_dt_min), math.log(m.mamba_dt_max)
        dt = torch.exp(torch.rand(shape, generator=gen, device=device) * (hi - lo) + lo)
        dt = dt.clamp(min=m.mamba_dt_init_floor)
        return dt + torch.log(-torch.expm1(-dt))
    if _is(gname, "D", "norm.weight") or gname.endswith((".norm.weight", "final_norm.weight")):
        return torch.ones(shape, device=device)
    if _is(gname, "conv1d.weight", "conv1d_weight"):
        bound = 1.0 / math.sqrt(m.mamba_conv_kernel)
        return torch.empty(shape, device=device).uniform_(-bound, bound, generator=gen)
    return None


def tp_parts(gname: str, m: Any) -> list[int] | None:
    """The full sizes of the parts a TP-split tensor is split by, part by part (None: split evenly)."""
    if _is(gname, "in_proj.weight"):
        return list(hybrid.in_proj_parts(m).values())
    if _is(gname, "conv1d.weight", "conv1d.bias", "conv1d_weight", "conv1d_bias"):
        return list(hybrid.conv_parts(m).values())
    return None
