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

from model_providers.core import fusions, hybrid, windows
from model_providers.core.knobs import FP8, GPT, MLA, MOE, MTP, TC, YARN, mcore_kwargs
from model_providers.core.linear_layers import has_linear_attention
from model_providers.core.model_plan import ModelPlan
from model_providers.core.optional_modules import feature as _feature
from model_providers.core.performance import performance_kwargs
from model_providers.core.sequences import shapes_vary
from model_providers.core.specs import decoder_block_spec, mtp_block_spec


def transformer_config(plan: ModelPlan, layout: Any) -> TransformerConfig:
    """Megatron-Core `TransformerConfig` for the run's model, layout and numerics.

    Every model field declared as feeding `TransformerConfig` (`knob(mcore=TC)`, `pretrain/sections/model.py`) is
    passed under its Megatron-Core name (`mcore_kwargs`); the values the run derives come from the named functions
    below, which take precedence: `shape_fields`, `parallel_fields`, `numerics_fields`, `fusion_fields`,
    `window_fields`, `fp8_fields`, `moe_config`, `mla_config`, `yarn_fields`, the performance section's
    `performance_kwargs`, and a hybrid Mamba model's `mamba_builder.hybrid_fields`.

    `plan`: the run's `ModelPlan` (`RunPlan.model`); `layout`: its `pretrain.layout.Layout` (derived facts: sizes,
    precision, spec choice, shape defaults).
    """
    m = plan.config
    kwargs = {**mcore_kwargs(m, TC), **shape_fields(m, layout), **parallel_fields(plan, layout),
              **numerics_fields(layout), **fusion_fields(plan, layout), **window_fields(m)}
    if m.fp8:
        kwargs.update(fp8_fields(m))
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
        kwargs.update(mcore_kwargs(m, MTP))
    if hybrid.is_hybrid(m):  # Megatron-Core's MambaModel (model_providers/core/mamba_builder.py)
        kwargs.update(_feature("mamba_builder").hybrid_fields(m, layout))
    kwargs.update(plan.qk_clip)  # Megatron-Core's QK-clip (MuonClip) when optimizer.muon.qk_clip is on
    if m.multi_latent_attention:
        return MLATransformerConfig(**{**kwargs, **mla_config(m)})
    config = TransformerConfig(**kwargs)
    if m.position_embedding_type == "yarn":
        yarn_fields(config, m)
    return config


def shape_fields(m, layout: Any) -> dict:
    """The shape fields whose null the layout resolves (`pretrain.layout.model_shape`), the activation function
    `model.activation` names, and list fields copied (Megatron-Core may extend them)."""
    return dict(ffn_hidden_size=layout.ffn_hidden_size, num_query_groups=layout.num_query_groups,
                activation_func=_activation(m.activation),
                recompute_modules=list(m.recompute_modules) if m.recompute_modules is not None else None)


def parallel_fields(plan: ModelPlan, layout: Any) -> dict:
    """The parallel layout (`pretrain.layout.Layout`) and the pipeline / context-parallel communication settings."""
    on_gpu = layout.on_gpu
    # None: on GPU only (gloo: interleaved PP=2 with batched p2p swaps same-shape messages silently).
    batch_p2p = on_gpu if plan.batch_p2p_comm is None else plan.batch_p2p_comm
    return dict(
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
        batch_p2p_comm=batch_p2p,
        batch_p2p_sync=on_gpu,
        # Packed documents under CP are padded per microbatch: pipeline stages exchange shapes first.
        variable_seq_lengths=shapes_vary(plan.packed_documents, layout),
        deallocate_pipeline_outputs=True,
        tp_comm_overlap=plan.tp_comm_overlap,
    )


def numerics_fields(layout: Any) -> dict:
    """Precision, initialisation and the loss's normalisation."""
    dtype, precision = layout.params_dtype, layout.precision
    return dict(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        # Megatron's init also sets the tensor-parallel attributes (partition_dim, ...) that DDP, grad
        # clipping and our own init rely on; initialize_layout_invariant then redraws every weight.
        perform_initialization=True,
        use_cpu_initialization=not layout.on_gpu,
        # Loss = sum over tokens; finalize_model_grads divides by the global token count.
        calculate_per_token_loss=True,
    )


def fusion_fields(plan: ModelPlan, layout: Any) -> dict:
    """Fused kernels (they need CUDA kernels or apex; the local spec on CPU runs the plain paths) and the spec."""
    m, on_gpu, use_te = plan.config, layout.on_gpu, layout.use_te
    return dict(
        bias_activation_fusion=fusions.bias_activation_fusion(m, on_gpu, use_te),
        masked_softmax_fusion=fusions.masked_softmax_fusion(on_gpu, per_document_mask=plan.packed_documents,
                                                            windowed=windows.window_size(m) is not None),
        bias_dropout_fusion=on_gpu,
        # MLA fuses RoPE only for YaRN (MLATransformerConfig refuses it with plain RoPE).
        apply_rope_fusion=on_gpu and use_te and (not m.multi_latent_attention or m.rope_type == "yarn"),
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=on_gpu,
        transformer_impl="transformer_engine" if use_te else "local",
    )


def window_fields(m) -> dict:
    """Sliding-window attention (model_providers/core/windows.py: transformers' window W is (W-1, 0))."""
    return dict(window_size=windows.window_size(m), window_attn_skip_freq=windows.skip_freq(m))


def fp8_fields(m) -> dict:
    """FP8 (`model.fp8` set): Transformer Engine's hybrid format with the recipe and parameter all-gather."""
    return dict(fp8="hybrid", **mcore_kwargs(m, FP8))


def _activation(name: str):
    """Megatron-Core's activation function for `model.activation`."""
    if name == "quick_gelu":
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        return quick_gelu
    if name == "squared_relu":
        from megatron.core.activations import squared_relu

        return squared_relu
    return F.silu if name == "silu" else F.gelu


def yarn_fields(config: TransformerConfig, m) -> None:
    """YaRN RoPE (`position_embedding_type=yarn`): Megatron-Core's `GPTModel` and attention read `yarn_*` attributes
    of the config that `TransformerConfig` does not declare (the attention applies the concentration factor
    `mscale` to cos/sin): the fields declared `mcore=YARN` (our keys are MLA's YaRN names)."""
    for name, value in mcore_kwargs(m, YARN).items():
        setattr(config, name, value)


def mla_config(m) -> dict:
    """Megatron-Core's MLATransformerConfig fields (declared `mcore=MLA`: the same names as our `model.*` keys)."""
    return mcore_kwargs(m, MLA)


def moe_config(m, layout: Any) -> dict:
    """The MoE fields of Megatron-Core's TransformerConfig (declared `mcore=MOE`), with the expert layout, the expert
    FFN size and grouped GEMM resolved.

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
        mcore_kwargs(m, MOE),
        moe_ffn_hidden_size=layout.moe_ffn_hidden_size,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff * sliced,
        moe_z_loss_coeff=m.moe_z_loss_coeff * sliced if m.moe_z_loss_coeff is not None else None,
        moe_grouped_gemm=layout.use_te if m.moe_grouped_gemm is None else m.moe_grouped_gemm,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
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
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        if hybrid.is_hybrid(m):  # MambaModel's arguments: the fields declared mcore=HYBRID_MODEL
            model = _feature("mamba_builder").hybrid_model(config, plan, layout, stage, pre, post, _rotary_base(m))
            chunks.append(_finish(model, layout, vocab_size, padded))
            continue
        packed = plan.packed_documents
        model = GPTModel(
            config=config,
            transformer_layer_spec=decoder_block_spec(config, layout.use_te, vp_stage=stage, packed_sequences=packed),
            mtp_block_spec=mtp_block_spec(config, layout.use_te, vp_stage=stage, packed_sequences=packed),
            vocab_size=padded,
            pre_process=pre,
            post_process=post,
            vp_stage=stage,
            **gpt_model_fields(m),
        )
        if m.rope_scaling and hasattr(model, "rotary_pos_emb"):
            apply_rope_scaling(model, m)
        if model.pre_process and m.position_embedding_type == "learned_absolute":
            # Megatron creates this torch.nn.Embedding in fp32 (Megatron-LM casts it with Float16Module,
            # which this trainer does not use): in bf16 it would promote the hidden states to fp32.
            model.embedding.position_embeddings.to(dtype=config.params_dtype)
        chunks.append(_finish(model, layout, vocab_size, padded))
    if config.num_moe_experts:
        mark_expert_parameters(chunks)
    if config.softmax_type == "learnable":
        mark_sink_parameters(chunks)
    initialize_layout_invariant(chunks, plan, vocab_size, padded)
    return chunks


def _finish(model, layout: Any, vocab_size: int, padded: int):
    """A built chunk on its device, with the vocabulary padding masked in its logits."""
    if layout.on_gpu:
        model.cuda(torch.cuda.current_device())
    if model.post_process and padded > vocab_size:
        mask_padded_logits(model, vocab_size, padded)
    return model


def gpt_model_fields(m) -> dict:
    """`GPTModel`'s own arguments: the fields declared `mcore=GPT`, with the context length defaulted to the
    training length and RoPE's base typed as Megatron-Core types it."""
    return {**mcore_kwargs(m, GPT), "max_sequence_length": m.max_position_embeddings or m.seq_length,
            "rotary_base": _rotary_base(m)}


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
    if gname.endswith(("linear_proj.weight", "linear_fc2.weight", "self_attention.out_proj.weight",
                       ".mixer.out_proj.weight")):
        # Megatron's scaled output init: std / sqrt(2 · layers), of a hybrid model (is_hybrid_model) / sqrt(layers)
        return std / math.sqrt((1.0 if hybrid.is_hybrid(m) else 2.0) * m.num_layers)
    return std


def _is_glu_fc1(gname: str, m) -> bool:
    return m.gated_linear_unit and ".linear_fc1." in gname


def _tp_slice(full: torch.Tensor, dim: int, rank: int, size: int, parts: list[int] | None) -> torch.Tensor:
    """This TP rank's shard. A tensor of `parts` (full sizes along `dim`) holds every part's shard on every rank
    (a gated fc1 is [gate; up]; Mamba's in_proj [z; x; B; C; dt]), so shard part by part."""
    if not parts:
        return full.narrow(dim, rank * size, size)
    tp = full.shape[dim] // size
    shards = [p.narrow(dim, rank * (n // tp), n // tp) for p, n in zip(full.split(parts, dim=dim), parts)]
    return torch.cat(shards, dim=dim)


def _tp_parts(gname: str, m, full_rows: int) -> list[int] | None:
    """The parts a TP-split tensor is split by, part by part: a gated fc1's halves; a hybrid Mamba model's or a Gated
    DeltaNet layer's fused in_proj / conv1d (`mamba_builder.tp_parts`, `linear_attention.tp_parts`); else None."""
    if _is_glu_fc1(gname, m):
        return [full_rows // 2, full_rows // 2]
    if hybrid.is_hybrid(m):
        return _feature("mamba_builder").tp_parts(gname, m)
    return _feature("linear_attention").tp_parts(gname, m) if has_linear_attention(m) else None


def _initial_value(gname: str, shape: list[int], gen: torch.Generator, m, device) -> torch.Tensor | None:
    """A mixer parameter's own initial value on its full shape (Mamba's, Gated DeltaNet's), None for the generic."""
    if hybrid.is_hybrid(m):
        return _feature("mamba_builder").initial_value(gname, shape, gen, m, device)
    return _feature("linear_attention").initial_value(gname, shape, gen, m, device) if has_linear_attention(m) else None


@torch.no_grad()
def initialize_layout_invariant(chunks: list[GPTModel], plan: ModelPlan, vocab_size: int,
                                padded_vocab: int) -> None:
    """Draw every parameter on its full shape from (seed, global name), then keep this rank's slice.

    Matrices ~ N(0, std) (output projections scaled by 1/sqrt(2·layers)), norm weights 1 (0 when zero-centred),
    biases 0; a mixer's own parameters (Mamba's, Gated DeltaNet's: `_initial_value`), and fused tensors split over
    TP part by part (`_tp_parts`).
    Embedding rows past the real vocabulary (TP padding) are zero, so padding never changes values.
    """
    seed, m = plan.seed, plan.config
    for chunk in chunks:
        names = global_parameter_names(chunk)
        for local, param in chunk.named_parameters():
            gname = names[local]
            full_shape, dim, rank = _full_shape(param, gname)
            if gname.endswith("bias") and not gname.endswith(".dt_bias"):  # dt_bias: drawn below
                param.zero_()
                continue
            if param.dim() == 1 and _NORM_RE.search(gname) is not None:
                param.fill_(0.0 if m.layernorm_zero_centered_gamma else 1.0)
                continue
            gen = torch.Generator(device=param.device)
            gen.manual_seed(_seed_for(seed, gname))
            special = _initial_value(gname, full_shape, gen, m, param.device)
            if special is not None:
                full = special
            elif gname in ("embedding.word_embeddings.weight", "output_layer.weight"):
                rows = torch.empty([vocab_size, *full_shape[1:]], dtype=torch.float32, device=param.device)
                rows.normal_(0.0, _std_for(gname, m), generator=gen)
                full = torch.zeros(full_shape, dtype=torch.float32, device=param.device)
                full[:vocab_size] = rows
            else:
                full = torch.empty(full_shape, dtype=torch.float32, device=param.device)
                full.normal_(0.0, _std_for(gname, m), generator=gen)
            if dim is not None:
                full = _tp_slice(full, dim, rank, param.shape[dim], _tp_parts(gname, m, full.shape[dim]))
            param.copy_(full.to(param.dtype))
