"""Layer specs, chosen in one place: Transformer Engine on CUDA when importable, else Megatron-Core's
local spec with a norm that supports sequence parallelism (torch's own norms refuse it without apex).

MoE layers (`config.num_moe_experts`) use Megatron-Core's MoE spec: TE grouped GEMM experts with the TE spec
(`moe_grouped_gemm`), experts run one after another (`SequentialMLP`) with the local spec. Both store the
pre-MLP norm as `pre_mlp_layernorm.weight` and experts under the same global keys, so checkpoints move
between CPU and GPU.

Context parallelism (CP > 1) or packed sequences (THD) with the local spec: core attention is
`model_providers.core.cp_attention.ContextParallelAttention` (Megatron-Core's `DotProductAttention` refuses both);
it has no parameters, so checkpoints are the same as with `DotProductAttention`."""

from __future__ import annotations

import functools

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from model_providers.core.cp_attention import ContextParallelAttention


@functools.lru_cache(maxsize=1)
def transformer_engine_available() -> bool:
    """True when CUDA is present and Transformer Engine's torch extension imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a partial TE install raises RuntimeError, not ImportError
        return False
    return True


class SequenceParallelNorm:
    """torch RMSNorm/LayerNorm whose parameters are marked for sequence-parallel grad all-reduce.

    With sequence parallelism each TP rank normalises a slice of the sequence, so the norm's weight
    gradients are partial sums that Megatron's DDP all-reduces across TP when the parameter carries
    `sequence_parallel = True`. (Megatron-Core's own torch wrapper asserts SP is off without apex.)
    Constructed like a spec module; returns the plain torch norm, so parameter names are unchanged.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization '{config.normalization}' is not supported by the local spec")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def decoder_block_spec(config: TransformerConfig, use_te: bool, vp_stage: int | None = None,
                       packed_sequences: bool = False) -> ModuleSpec:
    """The decoder block spec for this rank's pipeline stage (and virtual stage). `packed_sequences`: attention
    receives THD `PackedSeqParams` (documents packed in a sample)."""
    experts = config.num_moe_experts
    if use_te:
        layer = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=bool(config.moe_grouped_gemm), qk_layernorm=config.qk_layernorm)
        norm = None  # TransformerBlock picks TENorm itself
    else:
        layer = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm,
                                         num_experts=experts)
        layer.submodules.input_layernorm = SequenceParallelNorm
        layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
        if config.qk_layernorm:  # per-head norms; Megatron all-reduces their grads across TP (qk_layernorm)
            layer.submodules.self_attention.submodules.q_layernorm = SequenceParallelNorm
            layer.submodules.self_attention.submodules.k_layernorm = SequenceParallelNorm
        if config.context_parallel_size > 1 or packed_sequences:
            layer.submodules.self_attention.submodules.core_attention = ContextParallelAttention
        if experts:
            # A separate norm before the router (as with the TE spec), not one fused into a dense fc1.
            layer.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.", None)
        norm = SequenceParallelNorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if norm is None:
        return layer
    submodules = TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=norm)
    return ModuleSpec(module=TransformerBlock, submodules=submodules)
