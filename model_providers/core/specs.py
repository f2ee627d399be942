"""Layer specs, chosen in one place: Transformer Engine on CUDA when importable, else Megatron-Core's
local spec with a norm that supports sequence parallelism (torch's own norms refuse it without apex).

MoE layers (`config.num_moe_experts`) use Megatron-Core's MoE spec: TE grouped GEMM experts with the TE spec
(`moe_grouped_gemm`), experts run one after another (`SequentialMLP`) with the local spec. Both store the
pre-MLP norm as `pre_mlp_layernorm.weight` and experts under the same global keys, so checkpoints move
between CPU and GPU.

Multi-Latent Attention (`config.multi_latent_attention`) is Megatron-Core's `MLASelfAttention` from the same two
specs; dense-first models (`moe_layer_freq`) mix dense and MoE layer specs as Megatron-Core's block spec does;
Multi-Token Prediction is Megatron-Core's MTP block (`mtp_block_spec`, its layer the model's last decoder layer
spec) on the last pipeline rank, in the stage that holds it (the last, or the layout's `m` stage).

Context parallelism (CP > 1) or packed sequences (THD) with the local spec: core attention is
`model_providers.core.cp_attention.ContextParallelAttention` (Megatron-Core's `DotProductAttention` refuses both);
it has no parameters, so checkpoints are the same as with `DotProductAttention`."""

from __future__ import annotations

import functools

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from model_providers.core.cp_attention import ContextParallelAttention
from model_providers.core.experts import ExpertRowParallelLinear
from model_providers.core.linear_layers import has_linear_attention
from model_providers.core.norms import ZeroCenteredNorm


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
        if config.layernorm_zero_centered_gamma:  # weight (1 + w), as Transformer Engine's zero_centered_gamma
            norm = ZeroCenteredNorm(hidden_size, eps, config.normalization == "RMSNorm", config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization '{config.normalization}' is not supported by the local spec")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _local_layer_spec(config: TransformerConfig, experts: int | None, packed_sequences: bool = False) -> ModuleSpec:
    """Megatron-Core's local layer spec with norms that support sequence parallelism and the TE spec's keys; with
    CP > 1 or packed sequences, the context-parallel core attention (not for MLA: refused by validation)."""
    mla = bool(getattr(config, "multi_latent_attention", False))
    layer = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm,
                                     num_experts=experts, multi_latent_attention=mla)
    layer.submodules.input_layernorm = SequenceParallelNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
    attention = layer.submodules.self_attention.submodules
    if mla:
        _local_mla_norms(config, layer, attention, experts)
    elif config.qk_layernorm:  # per-head norms; Megatron all-reduces their grads across TP (qk_layernorm)
        attention.q_layernorm = SequenceParallelNorm
        attention.k_layernorm = SequenceParallelNorm
    if not mla and (config.context_parallel_size > 1 or packed_sequences):
        attention.core_attention = ContextParallelAttention
    if experts:
        # A separate norm before the router (as with the TE spec), not one fused into a dense fc1.
        layer.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.", None)
        if config.add_bias_linear:  # biased experts (GPT-OSS): model_providers/core/experts.py
            _submodules(_submodules(layer.submodules.mlp).experts).linear_fc2 = ExpertRowParallelLinear
    return layer


def _submodules(spec):
    """A spec's submodules: a `ModuleSpec`'s (0.16.1–0.18) or a `functools.partial`'s keyword (0.19's MoE specs)."""
    return spec.submodules if isinstance(spec, ModuleSpec) else spec.keywords["submodules"]


def _local_mla_norms(config: TransformerConfig, layer: ModuleSpec, attention, experts: int | None) -> None:
    """MLA on the local spec: the latent norms as SP-capable modules, stored under the TE spec's keys.

    The TE spec fuses the q/kv latent norms into `linear_q_up_proj` / `linear_kv_up_proj` and a dense layer's
    pre-MLP norm into `linear_fc1`; the local spec keeps them separate, so its checkpoint keys are mapped onto
    the TE ones (checkpoints move between CPU and GPU). Without q LoRA there is no query norm (Megatron-Core
    0.19 refuses a q_layernorm it would not use).
    """
    keys = {}
    if config.qk_layernorm:
        attention.kv_layernorm = SequenceParallelNorm
        keys["self_attention.kv_layernorm."] = "self_attention.linear_kv_up_proj.layer_norm_"
        if config.q_lora_rank is not None:
            attention.q_layernorm = SequenceParallelNorm
            keys["self_attention.q_layernorm."] = "self_attention.linear_q_up_proj.layer_norm_"
        else:
            attention.q_layernorm = IdentityOp
    if not experts:
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    layer.submodules.sharded_state_dict_keys_map = keys


def moe_layer_pattern(config: TransformerConfig) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per layer (Megatron-Core's `moe_layer_freq` rule)."""
    if not config.num_moe_experts:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)


def _layer_specs(config: TransformerConfig, use_te: bool, packed_sequences: bool) -> tuple[dict, list[int], type]:
    """The layer spec of each layer kind (1: MoE, 0: dense), the kind of every layer of the model, and the norm."""
    experts = config.num_moe_experts
    pattern = moe_layer_pattern(config)
    mla = bool(getattr(config, "multi_latent_attention", False))
    if use_te:
        def te_layer(num_experts):
            return get_gpt_layer_with_transformer_engine_spec(
                num_experts=num_experts, moe_grouped_gemm=bool(config.moe_grouped_gemm) and bool(num_experts),
                qk_layernorm=config.qk_layernorm, multi_latent_attention=mla)

        if (all(pattern) or not experts) and not has_linear_attention(config):
            layer = te_layer(experts)
            return {1: layer, 0: layer}, pattern, None  # one spec for every layer; TransformerBlock picks TENorm
        from megatron.core.extensions.transformer_engine import TENorm

        return {1: te_layer(experts), 0: te_layer(None)}, pattern, TENorm
    kinds = {1: _local_layer_spec(config, experts, packed_sequences)} if experts else {}
    if not all(pattern):
        kinds[0] = _local_layer_spec(config, None, packed_sequences)
    return kinds, pattern, SequenceParallelNorm


def decoder_block_spec(config: TransformerConfig, use_te: bool, vp_stage: int | None = None,
                       packed_sequences: bool = False) -> ModuleSpec:
    """The decoder block spec for this rank's pipeline stage (and virtual stage). `packed_sequences`: attention
    receives THD `PackedSeqParams` (documents packed in a sample)."""
    kinds, pattern, norm = _layer_specs(config, use_te, packed_sequences)
    if norm is None:
        return kinds[1]  # one layer spec for every layer (TE): TransformerBlock builds this stage's layers
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    layers = [kinds[pattern[i]] for i in range(offset, offset + num_layers)]
    if has_linear_attention(config):  # Gated DeltaNet layers (Qwen3-Next); imported only where used
        from model_providers.core import linear_attention

        layers = linear_attention.apply_pattern(config, layers, offset, use_te)
    submodules = TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm)
    return ModuleSpec(module=TransformerBlock, submodules=submodules)


def mtp_block_spec(config: TransformerConfig, use_te: bool, vp_stage: int | None = None,
                   packed_sequences: bool = False):
    """Megatron-Core's Multi-Token Prediction block for this stage (None where it has none: a stage without the
    `m` layers, or a model without MTP). Its transformer layer is the spec of the model's last decoder layer (as
    Megatron-LM builds it from the whole decoder's layer specs), not this stage's: a stage may hold the MTP layers
    and no decoder layer (`...|mL`). On the local spec its three norms (enorm, hnorm, final) support sequence
    parallelism."""
    if not config.mtp_num_layers:
        return None
    kinds, pattern, _ = _layer_specs(config, use_te, packed_sequences)
    block = get_gpt_mtp_block_spec(config, kinds[pattern[-1]], use_transformer_engine=use_te, vp_stage=vp_stage)
    if block is not None and not use_te:
        for layer in block.layer_specs:
            layer.submodules.enorm = SequenceParallelNorm
            layer.submodules.hnorm = SequenceParallelNorm
            layer.submodules.layer_norm = SequenceParallelNorm
    return block
