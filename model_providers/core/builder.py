"""Build Megatron-Core `GPTModel` chunks from the run's model plan, with layout-invariant initialisation.

`build_model(plan.model, plan.layout)` (a `ModelPlan`: `model_providers/core/model_plan.py`, and the run's
`Layout`) returns one `GPTModel` per virtual pipeline stage held by this rank (a list of one without
interleaving). Weights are drawn by `initialize_layout_invariant`: each parameter on its full (unsharded)
shape from a generator seeded by (train.seed, global parameter name), then sliced to
this rank's shard, so every TP/PP/VP/DP layout starts from identical weights.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from model_providers.core import fusions, windows
from model_providers.core.model_plan import ModelPlan
from model_providers.core.performance import performance_kwargs
from model_providers.core.sequences import shapes_vary
from model_providers.core.specs import decoder_block_spec, mtp_block_spec


def transformer_config(plan: ModelPlan, layout: Any) -> TransformerConfig:
    """Megatron-Core `TransformerConfig` for the run's model, layout and numerics.

    `plan`: the run's `ModelPlan` (`RunPlan.model`); `layout`: its `pretrain.layout.Layout` (derived facts: sizes,
    precision, spec choice, shape defaults).
    """
    m = plan.config
    on_gpu, use_te, precision = layout.on_gpu, layout.use_te, layout.precision
    dtype = layout.params_dtype
    batch_p2p = plan.batch_p2p_comm
    if batch_p2p is None:
        # gloo: interleaved PP=2 with batched p2p swaps same-shape messages silently.
        batch_p2p = on_gpu
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=layout.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        kv_channels=m.kv_channels,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        pipeline_model_parallel_layout=layout.pipeline_layout,
        account_for_embedding_in_pipeline_split=layout.embedding_in_split,
        account_for_loss_in_pipeline_split=layout.loss_in_split,
        context_parallel_size=layout.cp,
        cp_comm_type=plan.cp_comm_type if layout.cp > 1 else None,
        sequence_parallel=layout.sp,
        normalization=m.normalization,
        layernorm_epsilon=m.layernorm_epsilon,
        gated_linear_unit=m.gated_linear_unit,
        activation_func=_activation(m.activation),
        glu_linear_offset=m.glu_linear_offset,
        activation_func_clamp_value=m.activation_func_clamp_value,
        softmax_type=m.softmax_type,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        apply_residual_connection_post_layernorm=m.apply_residual_connection_post_layernorm,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        # Megatron's init also sets the tensor-parallel attributes (partition_dim, ...) that DDP, grad
        # clipping and our own init rely on; initialize_layout_invariant then redraws every weight.
        perform_initialization=True,
        use_cpu_initialization=not on_gpu,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        recompute_modules=list(m.recompute_modules) if m.recompute_modules is not None else None,
        batch_p2p_comm=batch_p2p,
        batch_p2p_sync=on_gpu,
        # Packed documents under CP are padded per microbatch: pipeline stages exchange shapes first.
        variable_seq_lengths=shapes_vary(plan.packed_documents, layout),
        deallocate_pipeline_outputs=True,
        # Fusions need CUDA kernels (or apex); the local spec on CPU runs the plain paths.
        bias_activation_fusion=fusions.bias_activation_fusion(m, on_gpu, use_te),
        masked_softmax_fusion=fusions.masked_softmax_fusion(on_gpu, per_document_mask=plan.packed_documents,
                                                            windowed=windows.window_size(m) is not None),
        # Sliding-window attention (model_providers/core/windows.py: transformers' window W is (W-1, 0)).
        window_size=windows.window_size(m),
        window_attn_skip_freq=windows.skip_freq(m),
        bias_dropout_fusion=on_gpu,
        # MLA fuses RoPE only for YaRN (MLATransformerConfig refuses it with plain RoPE).
        apply_rope_fusion=on_gpu and use_te and (not m.multi_latent_attention or m.rope_type == "yarn"),
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=on_gpu,
        tp_comm_overlap=plan.tp_comm_overlap,
        transformer_impl="transformer_engine" if use_te else "local",
        # Loss = sum over tokens; finalize_model_grads divides by the global token count.
        calculate_per_token_loss=True,
    )
    if m.fp8:
        kwargs.update(fp8="hybrid", fp8_recipe=m.fp8, fp8_param=m.fp8_param_gather)
    if layout.moe:
        kwargs.update(moe_config(m, layout))
    elif kwargs["variable_seq_lengths"]:
        # No experts, so no dispatcher runs; TransformerConfig's default one (allgather) refuses variable sequence
        # lengths (packed documents under CP × PP), even on a dense model.
        kwargs["moe_token_dispatcher_type"] = "alltoall"
    perf = plan.performance
    if perf is not None:  # the performance section (GPU speed settings), under Megatron-Core's names
        kwargs.update(performance_kwargs(perf, layout.moe, set(TransformerConfig.__dataclass_fields__)))
    if m.mtp_num_layers:
        kwargs.update(mtp_num_layers=m.mtp_num_layers, mtp_loss_scaling_factor=m.mtp_loss_scaling_factor)
    if m.multi_latent_attention:
        kwargs.update(mla_config(m))
        kwargs.update(plan.qk_clip)  # Megatron-Core's QK-clip (MuonClip) when optimizer.muon.qk_clip is on
        return MLATransformerConfig(**kwargs)
    kwargs.update(plan.qk_clip)
    config = TransformerConfig(**kwargs)
    if m.position_embedding_type == "yarn":
        yarn_fields(config, m)
    return config


def _activation(name: str):
    """Megatron-Core's activation function for `model.activation`."""
    if name == "quick_gelu":
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return quick_gelu
    return F.silu if name == "silu" else F.gelu


def yarn_fields(config: TransformerConfig, m) -> None:
    """YaRN RoPE (`position_embedding_type=yarn`): Megatron-Core's `GPTModel` and attention read `yarn_*` attributes
    of the config that `TransformerConfig` does not declare (the attention applies the concentration factor
    `mscale` to cos/sin). Our keys are MLA's YaRN names."""
    config.yarn_rotary_scaling_factor = m.rotary_scaling_factor
    config.yarn_original_max_position_embeddings = m.original_max_position_embeddings
    config.yarn_beta_fast = m.beta_fast
    config.yarn_beta_slow = m.beta_slow
    config.yarn_mscale = m.mscale
    config.yarn_mscale_all_dim = m.mscale_all_dim
    config.yarn_correction_range_round_to_int = m.yarn_correction_range_round_to_int


def mla_config(m) -> dict:
    """Megatron-Core's MLATransformerConfig fields (the same names as our `model.*` keys)."""
    return dict(
        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim, rope_type=m.rope_type,
        rotary_base=m.rotary_base, rotary_percent=m.rotary_percent, rotary_scaling_factor=m.rotary_scaling_factor,
        original_max_position_embeddings=m.original_max_position_embeddings, beta_fast=m.beta_fast,
        beta_slow=m.beta_slow, mscale=m.mscale, mscale_all_dim=m.mscale_all_dim,
    )


def moe_config(m, layout: Any) -> dict:
    """The MoE fields of Megatron-Core's TransformerConfig (same names as our `model.*` keys).

    The aux-loss and z-loss coefficients are multiplied by `layout.moe_loss_scale`: with
    `calculate_per_token_loss` (ours), Megatron-Core 0.16.1–0.18 scale those losses by the tokens of the rank's
    own sequence slice (`router.py` `attach_and_log_load_balancing_loss`, `apply_z_loss`, which also divides the
    z-loss coefficient by TP×CP) while the LM-loss gradients are divided by the tokens of the whole sequence, so
    under sequence or context parallelism the router losses would pull TP×CP times too weakly (measured: TP2
    halves their gradient) and the scale is TP×CP; 0.19+ multiply by TP×CP themselves and the scale is 1
    (`pretrain.compat.mcore.moe_router_loss_scale`). The logged values divide by the coefficient and are
    unaffected.
    """
    sliced = layout.moe_loss_scale
    return dict(
        num_moe_experts=m.num_moe_experts,
        moe_ffn_hidden_size=layout.moe_ffn_hidden_size,
        moe_router_topk=m.moe_router_topk,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_dtype=m.moe_router_dtype,
        moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff * sliced,
        moe_z_loss_coeff=m.moe_z_loss_coeff * sliced if m.moe_z_loss_coeff is not None else None,
        moe_expert_capacity_factor=m.moe_expert_capacity_factor,
        moe_token_drop_policy=m.moe_token_drop_policy,
        moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity,
        moe_token_dispatcher_type=m.moe_token_dispatcher_type,
        moe_grouped_gemm=layout.use_te if m.moe_grouped_gemm is None else m.moe_grouped_gemm,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        # DeepSeek routing, shared experts and dense-first layers (defaults: off).
        moe_layer_freq=m.moe_layer_freq,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_router_num_groups=m.moe_router_num_groups,
        moe_router_group_topk=m.moe_router_group_topk,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
    )


def build_model(plan: ModelPlan, layout: Any) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), initialised layout-invariantly.

    `plan`: the run's `ModelPlan` (`RunPlan.model`); `layout`: its `pretrain.layout.Layout`, derived with the
    vocabulary known (`RunPlan.layout`).
    """
    config = transformer_config(plan, layout)
    m = plan.config
    vocab_size, padded = layout.vocab_size, layout.padded_vocab
    chunks = []
    for vp_stage in range(layout.vp):
        stage = vp_stage if layout.virtual_pipeline else None
        block = decoder_block_spec(config, layout.use_te, vp_stage=stage, packed_sequences=plan.packed_documents)
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            mtp_block_spec=mtp_block_spec(config, block, layout.use_te, vp_stage=stage),
            vocab_size=padded,
            max_sequence_length=m.max_position_embeddings or m.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
            position_embedding_type=m.position_embedding_type,
            rotary_percent=m.rotary_percent,
            rotary_base=_rotary_base(m),
            rope_scaling=m.rope_scaling,
            rope_scaling_factor=m.rope_scaling_factor,
            vp_stage=stage,
        )
        if m.rope_scaling and hasattr(model, "rotary_pos_emb"):
            apply_rope_scaling(model, m)
        if model.pre_process and m.position_embedding_type == "learned_absolute":
            # Megatron creates this torch.nn.Embedding in fp32 (Megatron-LM casts it with Float16Module,
            # which this trainer does not use): in bf16 it would promote the hidden states to fp32.
            model.embedding.position_embeddings.to(dtype=config.params_dtype)
        if layout.on_gpu:
            model.cuda(torch.cuda.current_device())
        if model.post_process and padded > vocab_size:
            mask_padded_logits(model, vocab_size, padded)
        chunks.append(model)
    if config.num_moe_experts:
        mark_expert_parameters(chunks)
    if config.softmax_type == "learnable":
        mark_sink_parameters(chunks)
    initialize_layout_invariant(chunks, plan, vocab_size, padded)
    return chunks


def _rotary_base(m) -> int | float:
    """RoPE theta as Megatron-Core types it (int), unless it has a fraction."""
    return int(m.rotary_base) if float(m.rotary_base).is_integer() else float(m.rotary_base)


def apply_rope_scaling(model: GPTModel, m) -> None:
    """Llama-3 RoPE scaling with the config's low/high frequency factors and original context.

    `GPTModel` passes only the factor to `RotaryEmbedding`, whose `_apply_scaling` then uses its defaults for
    the other three values (1, 4, 8192: Llama-3.1's). Recompute the inverse frequencies from the unscaled
    ones with all four values, through Megatron-Core's own `_apply_scaling`.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = model.rotary_pos_emb
    plain = RotaryEmbedding(kv_channels=model.config.kv_channels, rotary_percent=m.rotary_percent,
                            rotary_base=_rotary_base(m), use_cpu_initialization=True)
    inv_freq = rope._apply_scaling(
        plain.inv_freq, factor=m.rope_scaling_factor, low_freq_factor=m.rope_scaling_low_freq_factor,
        high_freq_factor=m.rope_scaling_high_freq_factor,
        original_max_position_embeddings=m.rope_scaling_original_max_position_embeddings)
    rope.inv_freq = inv_freq.to(rope.inv_freq.device)


def mark_expert_parameters(chunks: list[GPTModel]) -> None:
    """Treat expert weights as expert-parallel parameters at every EP size, EP1 included.

    Megatron-Core flags them (`allreduce=False`) only when EP > 1; then DDP reduces their gradients over the
    expert-data-parallel group and the optimizer becomes a chain (dense, experts) whose checkpoint keys carry a
    `chained_<i>.` prefix. At EP1 it would keep one optimizer (other keys: an EP2 checkpoint could not resume
    at EP1) and reduce expert gradients over the attention's data-parallel group, which misses ranks when
    expert TP differs from TP. Flagging them always gives one optimizer layout for every MoE checkpoint and
    the right reduction group (at EP1 with expert TP = TP it is the same group, so numerics do not change).
    """
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".mlp.experts." in name:
                param.allreduce = False


def mark_sink_parameters(chunks: list[GPTModel]) -> None:
    """Mark the learnable attention sinks (`core_attention.softmax_offset`, one per head of this TP rank) as
    tensor-parallel, split on dim 0, as their checkpoint entry already is (`DotProductAttention.sharded_state_dict`).

    Megatron-Core 0.16.1–0.19 create them without `tensor_model_parallel`: the gradient norm would then count only
    TP rank 0's sinks (`param_is_not_tensor_parallel_duplicate`), and the layout-invariant initialisation could not
    tell their full shape (all heads)."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name.endswith("core_attention.softmax_offset"):
                param.tensor_model_parallel = True
                param.partition_dim = 0
                param.partition_stride = 1


def mask_padded_logits(model: GPTModel, vocab_size: int, padded: int) -> None:
    """Give the TP-padding columns of the logits the lowest value, so they carry no probability.

    Padding depends on TP (multiple of make_vocab_size_divisible_by × TP); with plain zero logits the extra
    columns would change the softmax, hence the loss, from one layout to another (and from the HF model).
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    part = padded // tp
    columns = torch.arange(rank * part, (rank + 1) * part)
    padding = columns >= vocab_size
    if not bool(padding.any()):
        return
    on_device: dict[torch.device, torch.Tensor] = {}

    def hook(_module, _inputs, output):
        logits, bias = output
        mask = on_device.get(logits.device)
        if mask is None:
            mask = on_device[logits.device] = padding.to(logits.device)
        return logits.masked_fill(mask, torch.finfo(logits.dtype).min), bias

    model.output_layer.register_forward_hook(hook)


# --------------------------------------------------------------------------------------------------
# Layout-invariant initialisation
# --------------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.")
# Norm weights (set to 1): layer norms, MLA's latent norms, MTP's embedding/hidden norms (enorm, hnorm).
_NORM_RE = re.compile(r"layernorm|layer_norm|\.[eh]norm\.")
# Local experts: SequentialMLP `experts.local_experts.{j}.linear_fc1.weight`, TE grouped GEMM
# `experts.linear_fc1.weight{j}`; j is the index on this expert-parallel rank.
_SEQUENTIAL_EXPERT_RE = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT_RE = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")


def _global_expert_name(name: str, first_local_expert: int) -> str:
    """`...mlp.experts.{global index}.linear_fc1.weight` for either expert implementation, else `name`."""
    mo = _SEQUENTIAL_EXPERT_RE.search(name)
    if mo:
        return f"{name[:mo.start()]}.mlp.experts.{first_local_expert + int(mo.group(1))}.{mo.group(2)}"
    mo = _GROUPED_EXPERT_RE.search(name)
    if mo:
        return f"{name[:mo.start()]}.mlp.experts.{first_local_expert + int(mo.group(3))}.{mo.group(1)}.{mo.group(2)}"
    return name


def global_parameter_names(chunk: GPTModel) -> dict[str, str]:
    """Map a chunk's local parameter names to layout-independent global names.

    Local layer indices are replaced by the layer's global index, local expert indices by the expert's
    global index (so every expert-parallel layout draws the same expert weights); the output layer of a
    model with tied embeddings is the embedding matrix.
    """
    local_to_global = {}
    layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []
    for i, layer in enumerate(layers):
        local_to_global[str(i)] = str(layer.layer_number - 1)
    num_experts = chunk.config.num_moe_experts
    first_local_expert = 0
    if num_experts:
        ep = parallel_state.get_expert_model_parallel_world_size()
        first_local_expert = parallel_state.get_expert_model_parallel_rank() * (num_experts // ep)
    names = {}
    for name, _ in chunk.named_parameters():
        gname = _LAYER_RE.sub(lambda mo: f"decoder.layers.{local_to_global[mo.group(1)]}.", name)
        if num_experts:
            gname = _global_expert_name(gname, first_local_expert)
        if gname == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
            gname = "embedding.word_embeddings.weight"
        names[name] = gname
    return names


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _full_shape(param: torch.Tensor, gname: str) -> tuple[list[int], int | None, int]:
    """The unsharded shape, the TP-split dim and this rank's index in that split.

    Expert weights are split over expert TP: fc1 by rows, fc2 by columns. Their split is read from the name,
    because TE's grouped GEMM experts under expert parallelism are sharded by Megatron itself and carry no
    `tensor_model_parallel` attribute.
    """
    shape = list(param.shape)
    if ".mlp.experts." in gname:
        etp = parallel_state.get_expert_tensor_parallel_world_size()
        dim = 0 if ".linear_fc1.weight" in gname else 1 if ".linear_fc2.weight" in gname else None
        if etp == 1 or dim is None:
            return shape, None, 0
        shape[dim] *= etp
        return shape, dim, parallel_state.get_expert_tensor_parallel_rank()
    if getattr(param, "tensor_model_parallel", False):
        dim = param.partition_dim
        shape[dim] *= parallel_state.get_tensor_model_parallel_world_size()
        return shape, dim, parallel_state.get_tensor_model_parallel_rank()
    return shape, None, 0


def _std_for(gname: str, m) -> float:
    std = m.init_method_std
    if gname.endswith("linear_proj.weight") or gname.endswith("linear_fc2.weight"):
        return std / math.sqrt(2.0 * m.num_layers)  # Megatron's scaled output init
    return std


def _is_glu_fc1(gname: str, m) -> bool:
    return m.gated_linear_unit and ".linear_fc1." in gname


def _tp_slice(full: torch.Tensor, dim: int, rank: int, size: int, glu: bool) -> torch.Tensor:
    """This TP rank's shard. A gated fc1 is [gate; up] on every rank, so shard each half."""
    if not glu:
        return full.narrow(dim, rank * size, size)
    gate, up = full.chunk(2, dim=dim)
    half = size // 2
    return torch.cat([gate.narrow(dim, rank * half, half), up.narrow(dim, rank * half, half)], dim=dim)


@torch.no_grad()
def initialize_layout_invariant(chunks: list[GPTModel], plan: ModelPlan, vocab_size: int,
                                padded_vocab: int) -> None:
    """Draw every parameter on its full shape from (seed, global name), then keep this rank's slice.

    Matrices ~ N(0, std) (output projections scaled by 1/sqrt(2·layers)), norm weights 1, biases 0.
    Embedding rows past the real vocabulary (TP padding) are zero, so padding never changes values.
    """
    seed, m = plan.seed, plan.config
    for chunk in chunks:
        names = global_parameter_names(chunk)
        for local, param in chunk.named_parameters():
            gname = names[local]
            full_shape, dim, rank = _full_shape(param, gname)
            is_norm = param.dim() == 1 and _NORM_RE.search(gname) is not None
            if gname.endswith("bias"):
                param.zero_()
                continue
            if is_norm:
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=param.device)
            gen.manual_seed(_seed_for(seed, gname))
            if gname in ("embedding.word_embeddings.weight", "output_layer.weight"):
                rows = torch.empty([vocab_size, *full_shape[1:]], dtype=torch.float32, device=param.device)
                rows.normal_(0.0, _std_for(gname, m), generator=gen)
                full = torch.zeros(full_shape, dtype=torch.float32, device=param.device)
                full[:vocab_size] = rows
            else:
                full = torch.empty(full_shape, dtype=torch.float32, device=param.device)
                full.normal_(0.0, _std_for(gname, m), generator=gen)
            if dim is not None:
                full = _tp_slice(full, dim, rank, param.shape[dim], glu=_is_glu_fc1(gname, m))
            param.copy_(full.to(param.dtype))
