"""Model rules: precision, sequence and shape lengths, the family's options."""

from __future__ import annotations

from pretrain.config import ModelConfig, ParallelConfig, TrainConfig
from pretrain.layout import padded_vocab_size
from pretrain.problems import Problem, Report


def precision_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig, train: TrainConfig,
                    te_on_gpu: bool) -> None:
    """Precision, FP8 and Transformer Engine."""
    m, p, t = model, parallel, train
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
    """The training length against the model's context: its learned position table. (A sliding window shorter
    than the training length is sliding-window attention: `pretrain/rules/windows.py`.)

    Also checked by `data_tools convert from-hf` before it writes anything.
    """
    out = []
    context = m.max_position_embeddings
    if m.position_embedding_type == "learned_absolute" and context is not None and m.seq_length > context:
        out.append(Problem(("model.seq_length", "model.max_position_embeddings"),
                           f"model.seq_length={m.seq_length} is longer than the learned position table "
                           f"(model.max_position_embeddings={context})", f"set model.seq_length <= {context}"))
    return out


def model_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig) -> None:
    """Model options Megatron-Core asserts on later, and the family fields that combine."""
    m, p = model, parallel
    r.errors.extend(length_problems(m))
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


