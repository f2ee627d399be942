"""Pre-flight validation: every layout and config rule, checked before any process group exists.

All violations are reported at once, each naming the keys involved and a fix. The trainer runs the
same checks first; `python -m pretrain validate CONFIG [overrides] --world-size N` runs them alone
(exit 2 on errors).
"""

from __future__ import annotations

import math

from pretrain.config import Config
from pretrain.layout import (
    Layout,
    LayoutError,
    derive_layout,
    expert_layout,
    model_shape,
    padded_vocab_size,
    te_available,
    use_transformer_engine,
)
from pretrain.problems import Problem, Report, ValidationFailed

__all__ = ["Problem", "Report", "ValidationFailed", "length_problems", "validate"]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def validate(cfg: Config, world_size: int, *, te_on_gpu: bool | None = None,
             cuda_available: bool | None = None, files: bool = True, versions=None) -> Report:
    """Check `cfg` for a job of `world_size` processes. Never raises for config problems.

    Single-field choices (enums, families) were checked when the config was parsed; these are the rules
    that combine fields, the world size and this machine. `files=False` checks the config alone: the data
    section (blends, tokenizer, dataset files) and `checkpoint.pretrained` are skipped (the planner sizes
    layouts of configs whose data lives elsewhere).

    `versions` (a `pretrain.compat.matrix.Installed`): the installation to check; None: this interpreter's.
    """
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if te_on_gpu is None:
        te_on_gpu = te_available() if cuda_available else False
    r = Report(world_size)
    lay, rules = None, [_precision_rules, _optimizer_rules, _run_rules, _logging_rules]
    if _sizes_positive(r, cfg, world_size):  # else only the rules that do no arithmetic on the sizes
        try:
            lay = derive_layout(cfg, world_size, on_gpu=cuda_available, te=te_on_gpu)
        except LayoutError:
            pass
        rules = [_layout_rules, _moe_rules, _model_rules, *rules, _document_rules, _recompute_module_rules,
                 _fsdp_rules]
    if files:
        rules.append(_data_rules)
    for rule in rules:
        rule(r, cfg, lay, te_on_gpu)
    # Installed Python / megatron-core / Transformer Engine / torch against the supported matrix.
    from pretrain.compat import matrix

    matrix.check(r, versions, allow_untested=cfg.run.allow_untested_versions)
    return r


def _sizes_positive(r: Report, cfg: Config, world_size: int) -> bool:
    """Sizes must be positive before any arithmetic below."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    positive = {
        "parallel.tensor": p.tensor, "parallel.pipeline": p.pipeline, "parallel.context": p.context,
        "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
        "model.num_attention_heads": m.num_attention_heads, "model.seq_length": m.seq_length,
        "train.micro_batch_size": t.micro_batch_size, "train.global_batch_size": t.global_batch_size,
        "train.steps": t.steps, "model.make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "parallel.expert": p.expert,
        "parallel.expert_tensor": 1 if p.expert_tensor is None else p.expert_tensor,
        "model.num_moe_experts": 1 if m.num_moe_experts is None else m.num_moe_experts,
        "model.moe_ffn_hidden_size": 1 if m.moe_ffn_hidden_size is None else m.moe_ffn_hidden_size,
        "model.moe_router_topk": m.moe_router_topk,
    }  # fmt: skip
    bad = [k for k, v in positive.items() if v < 1]
    for key in bad:
        r.error(key, f"{key}={positive[key]} must be at least 1", f"set {key} to a positive integer")
    if world_size < 1:
        r.error("world_size", f"world size {world_size} must be at least 1", "launch at least one process")
    return not (bad or world_size < 1)


def _layout_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """World = TP × PP × CP × DP; layers, heads, sequence and batch divisible by what splits them."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
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
    if vp is not None:
        if vp < 2:
            r.error("parallel.virtual_pipeline", f"parallel.virtual_pipeline={vp} must be at least 2",
                    "set parallel.virtual_pipeline=null for no interleaving")
        elif p.pipeline < 2:
            r.error(("parallel.virtual_pipeline", "parallel.pipeline"),
                    f"interleaving (parallel.virtual_pipeline={vp}) needs parallel.pipeline > 1",
                    "set parallel.pipeline >= 2 or parallel.virtual_pipeline=null")
    stages = p.pipeline * (vp if vp and vp >= 2 else 1)
    if m.num_layers % stages != 0:
        keys = ("model.num_layers", "parallel.pipeline") + (("parallel.virtual_pipeline",) if vp else ())
        r.error(keys, f"model.num_layers={m.num_layers} is not divisible by pipeline stages "
                f"{p.pipeline}{f'×{vp}' if vp else ''} = {stages}",
                f"choose a stage count dividing {m.num_layers} ({_divisors(m.num_layers)})")

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
        if m.seq_length % (2 * p.context) != 0:
            r.error(("model.seq_length", "parallel.context"),
                    f"model.seq_length={m.seq_length} is not divisible by 2×parallel.context = {2 * p.context}",
                    f"use a sequence length that is a multiple of {2 * p.context}")
        if not te_on_gpu:
            r.error("parallel.context", f"parallel.context={p.context} needs Transformer Engine on a GPU "
                    "(Megatron-Core implements context parallelism only in TE attention)",
                    "set parallel.context=1 here, or run on a CUDA machine with transformer-engine installed")
        elif m.transformer_impl == "local":
            r.error(("parallel.context", "model.transformer_impl"),
                    "context parallelism needs the Transformer Engine spec", "set model.transformer_impl=auto")

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


def _moe_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Mixture of Experts: expert groups, routing, capacity and the spec."""
    m, p = cfg.model, cfg.parallel
    etp = p.expert_tensor or p.tensor
    if m.num_moe_experts is None:
        if p.expert > 1 or p.expert_tensor is not None:
            keys = ("parallel.expert",) if p.expert > 1 else ("parallel.expert_tensor",)
            r.error(keys + ("model.num_moe_experts",), f"{keys[0]} is set but the model has no experts "
                    "(model.num_moe_experts is null)", f"set model.num_moe_experts or remove {keys[0]}")
        return
    experts = m.num_moe_experts
    if experts % p.expert != 0:
        r.error(("model.num_moe_experts", "parallel.expert"),
                f"model.num_moe_experts={experts} is not divisible by parallel.expert={p.expert}",
                f"choose parallel.expert from {_divisors(experts)}")
    if expert_layout(cfg, r.world_size) is None:
        per_stage = etp * p.expert * p.pipeline
        r.error(("parallel.expert_tensor", "parallel.expert", "parallel.pipeline"),
                f"world size {r.world_size} is not divisible by expert_tensor×expert×pipeline = "
                f"{etp}×{p.expert}×{p.pipeline} = {per_stage}",
                f"launch a multiple of {per_stage} processes, or choose expert sizes whose product divides "
                f"{r.world_size // p.pipeline if r.world_size % p.pipeline == 0 else r.world_size}")
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
    if m.add_bias_linear and etp != 1:
        r.error(("model.add_bias_linear", "parallel.expert_tensor"),
                "expert biases need expert tensor parallel 1 (Megatron-Core)", "set parallel.expert_tensor=1")
    if m.moe_aux_loss_coeff < 0 or (m.moe_z_loss_coeff or 0) < 0:
        r.error(("model.moe_aux_loss_coeff", "model.moe_z_loss_coeff"), "MoE loss coefficients must be >= 0",
                "set model.moe_aux_loss_coeff (and model.moe_z_loss_coeff) to 0 or more")
    cap = m.moe_expert_capacity_factor
    if cap is not None and cap <= 0:
        r.error("model.moe_expert_capacity_factor", f"model.moe_expert_capacity_factor={cap} must be positive",
                "set a positive factor (e.g. 1.25), or null for dropless routing")
    if m.moe_pad_expert_input_to_capacity and cap is None:
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


def _precision_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Precision, FP8 and Transformer Engine."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.transformer_impl == "transformer_engine" and not te_on_gpu:
        r.error("model.transformer_impl", "model.transformer_impl=transformer_engine but Transformer Engine "
                "is not usable here (needs CUDA and transformer-engine installed)",
                "set model.transformer_impl=auto (local spec) or install transformer-engine on a GPU machine")
    if m.fp8 is not None:
        if not te_on_gpu:
            r.error("model.fp8", "FP8 needs Transformer Engine on a GPU", "set model.fp8=null on this machine")
        if t.precision not in ("auto", "bf16"):
            r.error(("model.fp8", "train.precision"), "FP8 training runs on top of bf16",
                    "set train.precision=bf16 (or auto)")
    if m.fp8_param_gather and m.fp8 is None:
        r.error(("model.fp8_param_gather", "model.fp8"), "model.fp8_param_gather=true needs model.fp8",
                "set model.fp8 to a recipe or model.fp8_param_gather=false")
    if p.tp_comm_overlap:
        if not te_on_gpu:
            r.error("parallel.tp_comm_overlap", "TP communication overlap needs Transformer Engine on a GPU",
                    "set parallel.tp_comm_overlap=false")
        if not p.sequence_parallel:
            r.error(("parallel.tp_comm_overlap", "parallel.sequence_parallel"),
                    "TP communication overlap needs sequence parallelism", "set parallel.sequence_parallel=true")


def length_problems(m) -> list[Problem]:
    """The training length against the model's context: its sliding window and its learned position table.

    Also checked by `data_tools convert from-hf` before it writes anything.
    """
    out = []
    if m.sliding_window is not None and m.seq_length > m.sliding_window:
        out.append(Problem(("model.seq_length", "model.sliding_window"),
                           f"model.seq_length={m.seq_length} is longer than the model's attention window "
                           f"model.sliding_window={m.sliding_window}: sliding-window attention is not implemented, "
                           f"and full attention over more than {m.sliding_window} tokens is not what the model "
                           "computes", f"set model.seq_length <= {m.sliding_window}"))
    context = m.max_position_embeddings
    if m.position_embedding_type == "learned_absolute" and context is not None and m.seq_length > context:
        out.append(Problem(("model.seq_length", "model.max_position_embeddings"),
                           f"model.seq_length={m.seq_length} is longer than the learned position table "
                           f"(model.max_position_embeddings={context})", f"set model.seq_length <= {context}"))
    return out


def _model_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Model options Megatron-Core asserts on later, and the family fields that combine."""
    m, p = cfg.model, cfg.parallel
    r.errors.extend(length_problems(m))
    for key in ("max_position_embeddings", "sliding_window"):
        value = getattr(m, key)
        if value is not None and value < 1:
            r.error(f"model.{key}", f"model.{key}={value} must be at least 1", f"set model.{key} or null")
    if m.rope_scaling and m.rope_scaling_high_freq_factor <= m.rope_scaling_low_freq_factor:
        r.error(("model.rope_scaling_high_freq_factor", "model.rope_scaling_low_freq_factor"),
                f"RoPE scaling needs model.rope_scaling_high_freq_factor={m.rope_scaling_high_freq_factor} above "
                f"model.rope_scaling_low_freq_factor={m.rope_scaling_low_freq_factor}", "use e.g. 4 (high) and 1 (low)")
    if (m.position_embedding_type == "rope" and m.max_position_embeddings is not None
            and m.seq_length > m.max_position_embeddings):
        r.notes.append(f"model.seq_length={m.seq_length} is beyond the model's context length "
                       f"model.max_position_embeddings={m.max_position_embeddings} (RoPE allows it; raise "
                       "model.max_position_embeddings if the context is being extended)")
    if m.recompute_granularity == "full":
        if m.recompute_method is None:
            r.error(("model.recompute_granularity", "model.recompute_method"),
                    "full recompute needs model.recompute_method uniform or block",
                    "set model.recompute_method=uniform (and model.recompute_num_layers)")
        if not m.recompute_num_layers:
            r.error(("model.recompute_granularity", "model.recompute_num_layers"),
                    "full recompute needs model.recompute_num_layers", "set model.recompute_num_layers=1")
    elif m.recompute_method is not None:
        r.error(("model.recompute_method", "model.recompute_granularity"),
                "model.recompute_method is only used with model.recompute_granularity=full",
                "set model.recompute_granularity=full or model.recompute_method=null")
    if m.vocab_size is not None:
        padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tensor)
        if padded != m.vocab_size:
            r.notes.append(f"vocabulary {m.vocab_size} is padded to {padded} (multiple of "
                           f"model.make_vocab_size_divisible_by×parallel.tensor = "
                           f"{m.make_vocab_size_divisible_by}×{p.tensor}); padding rows are zero and dropped on "
                           "HF export")


def _optimizer_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Optimizer and schedule."""
    o, t = cfg.optimizer, cfg.train
    if o.overlap_param_gather and not o.distributed:
        r.error(("optimizer.overlap_param_gather", "optimizer.distributed"),
                "optimizer.overlap_param_gather needs the distributed optimizer", "set optimizer.distributed=true")
    if o.overlap_param_gather and not o.overlap_grad_reduce:
        r.error(("optimizer.overlap_param_gather", "optimizer.overlap_grad_reduce"),
                "optimizer.overlap_param_gather needs optimizer.overlap_grad_reduce",
                "set optimizer.overlap_grad_reduce=true")
    for key, value in (("optimizer.lr", o.lr), ("optimizer.min_lr", o.min_lr),
                       ("optimizer.weight_decay", o.weight_decay)):
        if not math.isfinite(value) or value < 0:
            r.error(key, f"{key}={value} must be 0 or more", f"set {key} to a number that is 0 or more")
    if o.lr == 0:
        r.notes.append("optimizer.lr=0: the weights never change (an evaluation-only run)")
    if o.min_lr > o.lr:
        r.error(("optimizer.min_lr", "optimizer.lr"), f"optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}",
                "set min_lr <= lr")
    if o.decay_style == "WSD" and not o.wsd_decay_steps:
        r.error(("optimizer.decay_style", "optimizer.wsd_decay_steps"), "WSD decay needs optimizer.wsd_decay_steps",
                "set optimizer.wsd_decay_steps (e.g. 10% of train.steps)")
    if o.warmup_steps < 0:
        r.error("optimizer.warmup_steps", f"optimizer.warmup_steps={o.warmup_steps} is negative",
                "set optimizer.warmup_steps >= 0")
    elif o.warmup_steps >= (o.decay_steps or t.steps):
        r.notes.append(f"optimizer.warmup_steps={o.warmup_steps} >= decay steps {o.decay_steps or t.steps}: "
                       "the learning rate never reaches its peak")


def _run_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Training run: evaluation, time limit, checkpoints."""
    t, c = cfg.train, cfg.checkpoint
    if t.eval_interval is not None and (t.eval_interval < 1 or t.eval_iters < 1):
        r.error(("train.eval_interval", "train.eval_iters"), "evaluation needs eval_interval >= 1 and eval_iters >= 1",
                "set train.eval_interval=null to disable evaluation")
    if t.exit_duration_in_mins is not None and t.exit_duration_in_mins <= 0:
        r.error("train.exit_duration_in_mins", "train.exit_duration_in_mins must be positive",
                "set a positive number of minutes or null")
    if c.interval is not None and c.interval < 1:
        r.error("checkpoint.interval", f"checkpoint.interval={c.interval} must be at least 1",
                "set checkpoint.interval=null to save only at the end")
    if c.keep_last is not None and c.keep_last < 1:
        r.error("checkpoint.keep_last", f"checkpoint.keep_last={c.keep_last} must be at least 1",
                "set checkpoint.keep_last=null to keep every checkpoint")


def _data_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Data sources, tokenizer and dataset files (pretrain/data_check.py), and the pretrained checkpoint."""
    from pretrain.data_check import check_data_config, check_data_files

    check_data_files(cfg, r, check_data_config(cfg, r))
    _check_pretrained(cfg, r)


def _check_pretrained(cfg: Config, r: Report) -> None:
    """checkpoint.pretrained names a complete checkpoint (a run dir, a checkpoints dir or an iteration dir)."""
    if not cfg.checkpoint.pretrained:
        return
    from pretrain.checkpoint.format import CheckpointError, resolve_checkpoint

    try:
        resolve_checkpoint(cfg.checkpoint.pretrained)
    except (CheckpointError, OSError) as e:
        r.error("checkpoint.pretrained", f"checkpoint.pretrained: {e}",
                "give a run directory, its checkpoints/ directory or an iter_NNNNNNN directory, or remove the key")


def _document_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Document boundaries in packed samples: refuse settings an attention implementation would ignore.

    Local spec (Megatron-Core `DotProductAttention`): applies the per-document mask on CPU and GPU (the trainer
    turns off the fused upper-triangular softmax kernel, which ignores explicit masks). Transformer Engine spec:
    attention is built with a causal mask type, for which TE applies its own causal mask and does not read the
    given one. RoPE in `GPTModel` follows the sequence index, not `position_ids`.
    """
    d, m = cfg.data, cfg.model
    use_te = lay.use_te if lay is not None else use_transformer_engine(m.transformer_impl, te_on_gpu)
    if d.reset_attention_mask and use_te:
        r.error(("data.reset_attention_mask", "model.transformer_impl"),
                "data.reset_attention_mask=true: Transformer Engine attention in Megatron-Core's spec uses a causal "
                "mask type and ignores a per-document mask (documents would attend across boundaries)",
                "set model.transformer_impl=local (Megatron-Core's DotProductAttention applies the mask on CPU and "
                "GPU) or data.reset_attention_mask=false")
    if d.reset_position_ids and m.position_embedding_type == "rope" and not d.reset_attention_mask:
        r.error(("data.reset_position_ids", "model.position_embedding_type"),
                "data.reset_position_ids=true has no effect with RoPE: Megatron-Core's GPTModel rotates by the "
                "sequence index, not by position_ids",
                "also set data.reset_attention_mask=true (then each document sees only its own tokens and RoPE's "
                "relative positions are the restarted ones), or set data.reset_position_ids=false")
    if d.reset_attention_mask and not use_te:
        r.notes.append(f"data.reset_attention_mask: a [{cfg.train.micro_batch_size}, 1, {m.seq_length}, "
                       f"{m.seq_length}] boolean mask per microbatch; the fused softmax kernel is off")


RECOMPUTE_DEFAULT = ("core_attn",)  # Megatron-Core's default recompute_modules


def _recompute_module_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """model.recompute_modules: only with selective recompute, not empty, and not a no-op under the TE spec."""
    m = cfg.model
    mods = m.recompute_modules
    if mods is None:
        return
    if m.recompute_granularity != "selective":
        r.error(("model.recompute_modules", "model.recompute_granularity"),
                "model.recompute_modules is only used with model.recompute_granularity=selective",
                "set model.recompute_granularity=selective or model.recompute_modules=null")
        return
    if not mods:
        r.error("model.recompute_modules", "model.recompute_modules=[] recomputes nothing",
                "list modules (core_attn, mlp, layernorm) or set model.recompute_granularity=null")
    if len(set(mods)) != len(mods):
        r.error("model.recompute_modules", f"model.recompute_modules={mods} names a module twice",
                "list each module once")
    use_te = lay.use_te if lay is not None else use_transformer_engine(m.transformer_impl, te_on_gpu)
    if "layernorm" in mods and use_te:
        r.error(("model.recompute_modules", "model.transformer_impl"),
                "recompute of layernorm does nothing with the Transformer Engine spec (both norms are fused into "
                "the following linear layers)", "remove layernorm, or set model.transformer_impl=local")


def _fsdp_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Megatron-FSDP (optimizer.fsdp): CUDA only in megatron-core 0.16.1, and no torch_dist checkpoints."""
    o, c, t = cfg.optimizer, cfg.checkpoint, cfg.train
    if not o.fsdp:
        return
    if lay is not None and not lay.on_gpu:
        r.error("optimizer.fsdp", "Megatron-FSDP needs CUDA: megatron-core 0.16.1 builds its device as "
                "cuda:<current device> and runs its all-gathers and reduce-scatters on torch.cuda.Stream side "
                "streams (megatron_fsdp.py:184, :361)", "set optimizer.fsdp=false here (optimizer.distributed=true "
                "shards the optimizer state), or run on a CUDA machine")
    saving = [k for k, on in (("checkpoint.interval", c.interval is not None),
                              ("checkpoint.save_at_end", c.save_at_end),
                              ("train.exit_signal_handler", t.exit_signal_handler),
                              ("train.exit_duration_in_mins", t.exit_duration_in_mins is not None),
                              ("checkpoint.pretrained", c.pretrained is not None)) if on]
    if saving:
        r.error(("optimizer.fsdp", *saving),
                "Megatron-FSDP state cannot go through the torch_dist checkpoint path: megatron-core 0.16.1 "
                "shards Megatron-FSDP optimizer state only in its fsdp_dtensor format (DistributedOptimizer."
                "sharded_state_dict raises NotImplementedError otherwise, distrib_optimizer.py:1229)",
                "run without checkpoints (checkpoint.interval=null checkpoint.save_at_end=false "
                "train.exit_signal_handler=false train.exit_duration_in_mins=null checkpoint.pretrained=null), or "
                "use optimizer.distributed=true")
    if t.nan_policy == "skip":
        r.error(("optimizer.fsdp", "train.nan_policy"), "train.nan_policy=skip checks DDP's gradient buffers, "
                "which Megatron-FSDP does not have", "set train.nan_policy=stop")


def _logging_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Weights & Biases, the profiler window and per-rank timing."""
    lg, steps = cfg.logging, cfg.train.steps
    w = lg.wandb
    if w.project is None and (w.entity is not None or w.name is not None):
        r.error(("logging.wandb.project",), "logging.wandb.entity/name are set but logging.wandb.project is null, "
                "so nothing goes to Weights & Biases", "set logging.wandb.project")
    if w.project is not None and w.mode != "disabled":
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            r.error("logging.wandb.project", "logging.wandb.project is set but the wandb package is not installed",
                    "pip install -e '.[wandb]' (or set logging.wandb.project=null)")
    p = lg.profile
    if p.start_step is None:
        if p.end_step is not None:
            r.error(("logging.profile.end_step", "logging.profile.start_step"),
                    "logging.profile.end_step is set without logging.profile.start_step",
                    "set logging.profile.start_step (the first profiled step)")
    else:
        end = p.end_step if p.end_step is not None else p.start_step
        if p.start_step < 1 or end < p.start_step:
            r.error(("logging.profile.start_step", "logging.profile.end_step"),
                    f"profile window {p.start_step}..{end} is empty or starts before step 1",
                    "use 1 <= start_step <= end_step")
        elif end > steps:
            r.error(("logging.profile.end_step", "train.steps"),
                    f"profile window ends at step {end}, after the last step (train.steps={steps})",
                    f"end the window by step {steps}")
        bad = [x for x in p.ranks if not 0 <= x < r.world_size]
        if not p.ranks or bad:
            r.error("logging.profile.ranks", f"logging.profile.ranks={p.ranks} must name ranks of the job "
                    f"(0..{r.world_size - 1})", "e.g. logging.profile.ranks=[0]")
    if lg.timing_interval is not None and lg.timing_interval < 1:
        r.error("logging.timing_interval", f"logging.timing_interval={lg.timing_interval} must be at least 1",
                "set logging.timing_interval=null to turn per-rank timing off")
