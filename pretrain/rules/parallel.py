"""Layout rules: world = TP × PP × CP × DP and what each parallel size must divide, expert parallelism."""

from __future__ import annotations

import dataclasses

from pretrain.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from pretrain.layout import Layout, expert_layout, expert_tensor_size, model_shape
from pretrain.problems import Report
from pretrain.rules.placement import explicit_placement, placement_rules


def _ranks_per_stage(world: int, pipeline: int) -> str:
    """What expert TP × EP must divide: the ranks of one pipeline stage, over which each stage's experts are split."""
    if world % pipeline:
        return f"the world size {world}"
    return (f"{world // pipeline} (world size {world} / parallel.pipeline={pipeline}: the ranks of one pipeline "
            "stage, over which its experts are split)")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def sizes_positive(r: Report, world_size: int, out_of_range: set[str]) -> bool:
    """Whether the sizes the layout arithmetic divides by are positive (`out_of_range`: the keys the range rule,
    `pretrain.rules.bounds.range_rules`, reported); a world size below 1 is reported here."""
    bad = [k for k in _SIZES if k in out_of_range]
    if world_size < 1 and not any(k.startswith("parallel.") for k in bad):  # else a knock-on of one reported
        r.error("world_size", f"world size {world_size} must be at least 1", "launch at least one process")
    return not (bad or world_size < 1)


_SIZES = ("parallel.tensor", "parallel.pipeline", "parallel.context", "parallel.expert", "parallel.expert_tensor",
          "model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.seq_length",
          "model.make_vocab_size_divisible_by", "model.num_moe_experts", "model.moe_ffn_hidden_size",
          "model.moe_router_topk", "train.micro_batch_size", "train.global_batch_size", "train.steps")


def layout_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig, data: DataConfig,
                 train: TrainConfig, lay: Layout | None) -> None:
    """World = TP × PP × CP × DP; layers, heads, sequence and batch divisible by what splits them."""
    m, p, t = model, parallel, train
    world_size = r.world_size
    vp = p.virtual_pipeline
    model_parallel = p.tensor * p.pipeline * p.context
    if world_size % model_parallel:
        r.error(("parallel.tensor", "parallel.pipeline", "parallel.context"),
                f"world size {world_size} is not divisible by tensor×pipeline×context = "
                f"{p.tensor}×{p.pipeline}×{p.context} = {model_parallel}",
                f"launch a multiple of {model_parallel} processes, or choose sizes whose product divides "
                f"{world_size}")

    # Layers across pipeline stages (Megatron-LM silently trains fewer layers otherwise).
    if vp is not None and vp >= 2:  # below 2: the range rule's (null: no interleaving)
        if p.pipeline < 2:
            r.error(("parallel.virtual_pipeline", "parallel.pipeline"),
                    f"interleaving (parallel.virtual_pipeline={vp}) needs parallel.pipeline > 1",
                    "set parallel.pipeline >= 2 or parallel.virtual_pipeline=null")
    stages = p.pipeline * (vp if vp and vp >= 2 else 1)
    uneven = p.num_layers_in_first_pipeline_stage is not None or p.num_layers_in_last_pipeline_stage is not None
    if explicit_placement(p):
        placement_rules(r, m, p)
    elif uneven:
        uneven_pipeline_rules(r, m, p)
    elif m.num_layers % stages != 0:
        keys = ("model.num_layers", "parallel.pipeline") + (("parallel.virtual_pipeline",) if vp else ())
        r.error(keys, f"model.num_layers={m.num_layers} is not divisible by pipeline stages "
                f"{p.pipeline}{f'×{vp}' if vp else ''} = {stages}",
                f"choose a stage count dividing {m.num_layers} ({_divisors(m.num_layers)}), or uneven stages "
                "(parallel.num_layers_in_first_pipeline_stage / ..._last_...), the embedding / loss counted as layers "
                "(parallel.account_for_embedding_in_pipeline_split / ..._loss_...) or any placement "
                "(parallel.pipeline_layout, Megatron-Core's pipeline_model_parallel_layout)")

    # Attention heads and groups across tensor parallel ranks.
    shape = model_shape(m)
    groups = shape.num_query_groups
    if m.num_attention_heads % p.tensor != 0:
        r.error(("model.num_attention_heads", "parallel.tensor"),
                f"model.num_attention_heads={m.num_attention_heads} is not divisible by parallel.tensor={p.tensor}",
                f"choose parallel.tensor from {_divisors(m.num_attention_heads)}")
    if groups % p.tensor != 0:
        r.error(("model.num_query_groups", "parallel.tensor"),
                f"model.num_query_groups={groups} is not divisible by parallel.tensor={p.tensor}",
                f"choose parallel.tensor from {_divisors(groups)}")
    if m.num_attention_heads % groups != 0:
        r.error(("model.num_attention_heads", "model.num_query_groups"),
                f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                f"model.num_query_groups={groups}", f"choose num_query_groups from {_divisors(m.num_attention_heads)}")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads != 0:
        r.error(("model.hidden_size", "model.num_attention_heads"),
                f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                f"{m.num_attention_heads}", "set model.kv_channels or change the head count")
    ffn = shape.ffn_hidden_size
    if ffn % p.tensor != 0:
        r.error(("model.ffn_hidden_size", "parallel.tensor"),
                f"model.ffn_hidden_size={ffn} is not divisible by parallel.tensor={p.tensor}",
                f"choose parallel.tensor from {_divisors(ffn)}")

    # Sequence and context parallelism.
    if p.sequence_parallel and p.tensor < 2:
        r.error(("parallel.sequence_parallel", "parallel.tensor"),
                "parallel.sequence_parallel=true needs parallel.tensor > 1",
                "set parallel.sequence_parallel=false or parallel.tensor >= 2")
    if p.sequence_parallel and m.seq_length % p.tensor != 0:
        r.error(("model.seq_length", "parallel.tensor", "parallel.sequence_parallel"),
                f"model.seq_length={m.seq_length} is not divisible by parallel.tensor={p.tensor} "
                "(sequence parallel splits the sequence across TP ranks)",
                f"use a sequence length that is a multiple of {p.tensor}")
    if p.context > 1:
        # Packed documents (data.reset_attention_mask) are padded per document instead (pretrain.data.datasets).
        if m.seq_length % (2 * p.context) != 0 and not data.reset_attention_mask:
            r.error(("model.seq_length", "parallel.context"),
                    f"model.seq_length={m.seq_length} is not divisible by 2×parallel.context = {2 * p.context}",
                    f"use a sequence length that is a multiple of {2 * p.context}")
        # Without Transformer Engine the local spec's CP attention runs it (pretrain.rules.context).

    # Batch sizes and microbatches.
    if lay is not None:
        dp = lay.dp
        per_step = t.micro_batch_size * dp
        if t.global_batch_size % per_step != 0:
            r.error(("train.global_batch_size", "train.micro_batch_size"),
                    f"train.global_batch_size={t.global_batch_size} is not divisible by "
                    f"micro_batch_size×data_parallel = {t.micro_batch_size}×{dp} = {per_step}",
                    f"use a global batch that is a multiple of {per_step}")
        else:
            num_mb = t.global_batch_size // per_step
            if vp and vp >= 2 and p.pipeline > 1 and num_mb % p.pipeline != 0:
                r.error(("train.global_batch_size", "parallel.pipeline", "parallel.virtual_pipeline"),
                        f"interleaved pipelining needs the number of microbatches ({num_mb}) to be divisible "
                        f"by parallel.pipeline={p.pipeline}",
                        f"use train.global_batch_size a multiple of {per_step * p.pipeline}")


def uneven_pipeline_rules(r: Report, m: ModelConfig, p: ParallelConfig) -> None:
    """parallel.num_layers_in_first/last_pipeline_stage: what Megatron-Core's TransformerConfig asserts on."""
    vp = p.virtual_pipeline if p.virtual_pipeline and p.virtual_pipeline >= 2 else 1
    keys = ("parallel.num_layers_in_first_pipeline_stage", "parallel.num_layers_in_last_pipeline_stage")
    if p.pipeline < 2:
        r.error(keys + ("parallel.pipeline",), "uneven pipeline stages need parallel.pipeline > 1",
                "set parallel.pipeline >= 2, or the stage layer counts to null")
        return
    middle_layers, middle_stages = m.num_layers, p.pipeline
    for key, value in zip(keys, (p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage)):
        if value is None:
            continue
        if value < 1:  # the range rule's
            return
        if value % vp:
            r.error((key, "parallel.virtual_pipeline"), f"{key}={value} must be divisible by "
                    f"parallel.virtual_pipeline={vp}", f"use a multiple of {vp}")
            return
        middle_layers -= value
        middle_stages -= 1
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
            middle_stages and (middle_layers % middle_stages or (middle_layers // middle_stages) % vp)):
        r.error(keys + ("model.num_layers", "parallel.pipeline"),
                f"model.num_layers={m.num_layers} leaves {middle_layers} layers for {middle_stages} middle pipeline "
                f"stage(s){f' × VP{vp}' if vp > 1 else ''}: they must split evenly",
                f"choose the first/last stage layers so that {m.num_layers} minus them divides by "
                f"{middle_stages * vp or 1}")


def _moe_keys_on_a_dense_model(r: Report, m) -> None:
    """MoE settings changed from their defaults on a model without experts would do nothing: refused."""
    defaults = {f.name: f.default for f in dataclasses.fields(m) if f.name.startswith("moe_")}
    changed = [f"model.{k}={getattr(m, k)}" for k, default in defaults.items() if getattr(m, k) != default]
    if changed:
        r.error(tuple(c.split("=")[0] for c in changed) + ("model.num_moe_experts",),
                f"{', '.join(changed)} set but the model has no experts (model.num_moe_experts is null): MoE "
                "settings do nothing on a dense model", "remove them, or set model.num_moe_experts for an MoE model")


def moe_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig, lay: Layout | None) -> None:
    """Mixture of Experts: expert groups, routing, capacity and the spec."""
    m, p = model, parallel
    etp = expert_tensor_size(p)
    if m.num_moe_experts is None:
        if p.expert > 1 or p.expert_tensor is not None:
            keys = ("parallel.expert",) if p.expert > 1 else ("parallel.expert_tensor",)
            r.error(keys + ("model.num_moe_experts",), f"{keys[0]} is set but the model has no experts "
                    "(model.num_moe_experts is null)", f"set model.num_moe_experts or remove {keys[0]}")
        _moe_keys_on_a_dense_model(r, m)
        return
    experts = m.num_moe_experts
    if experts % p.expert != 0:
        r.error(("model.num_moe_experts", "parallel.expert"),
                f"model.num_moe_experts={experts} is not divisible by parallel.expert={p.expert}",
                f"choose parallel.expert from {_divisors(experts)}")
    if expert_layout(p, r.world_size) is None:
        per_stage = etp * p.expert * p.pipeline
        r.error(("parallel.expert_tensor", "parallel.expert", "parallel.pipeline"),
                f"world size {r.world_size} is not divisible by expert_tensor×expert×pipeline = "
                f"{etp}×{p.expert}×{p.pipeline} = {per_stage}",
                f"launch a multiple of {per_stage} processes, or choose parallel.expert_tensor×parallel.expert "
                f"(now {etp}×{p.expert} = {etp * p.expert}) dividing {_ranks_per_stage(r.world_size, p.pipeline)}")
    ffn = model_shape(m).moe_ffn_hidden_size
    if ffn % etp != 0:
        r.error(("model.moe_ffn_hidden_size", "parallel.expert_tensor"),
                f"model.moe_ffn_hidden_size={ffn} is not divisible by expert tensor parallel {etp}",
                f"choose parallel.expert_tensor from {_divisors(ffn)}")
    if m.moe_router_topk > experts:
        r.error(("model.moe_router_topk", "model.num_moe_experts"),
                f"model.moe_router_topk={m.moe_router_topk} is more than model.num_moe_experts={experts}",
                f"choose moe_router_topk from 1 to {experts}")
    if p.tensor > 1 and not p.sequence_parallel:
        r.error(("parallel.sequence_parallel", "parallel.tensor", "model.num_moe_experts"),
                "MoE with parallel.tensor > 1 needs sequence parallelism (Megatron-Core refuses to train "
                "without it)", "set parallel.sequence_parallel=true")
    # biased experts need expert TP 1: one rule, pretrain/rules/sinks.py (glu_bias_yarn_rules)
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        r.error(("model.moe_pad_expert_input_to_capacity", "model.moe_expert_capacity_factor"),
                "padding expert inputs to capacity needs a capacity factor",
                "set model.moe_expert_capacity_factor or model.moe_pad_expert_input_to_capacity=false")
    if m.moe_router_score_function == "sigmoid" and m.moe_router_pre_softmax:
        r.error(("model.moe_router_pre_softmax", "model.moe_router_score_function"),
                "model.moe_router_pre_softmax applies to softmax scoring only",
                "set model.moe_router_pre_softmax=false")
    if m.moe_grouped_gemm and (lay is not None and not lay.use_te):
        r.error(("model.moe_grouped_gemm", "model.transformer_impl"),
                "model.moe_grouped_gemm=true needs the Transformer Engine spec (the local spec runs experts "
                "one after another)", "set model.moe_grouped_gemm=null, or run on a GPU with transformer-engine")


