"""The resume contract: what a resumed run may change and what it must keep, for every config field (one owner).

Before a checkpoint loads, `check_resume` compares the config it was written with (its `run_config.yaml`) and
the tokenizer it recorded with this run's, field by field. Every leaf of the config tree has one class in
`FIELDS` (`tests/pretrain/test_resume_contract.py` fails when a field is added without one):

- `MATCH`: must match, else the resume is refused naming each key (the model's identity and the tokenizer,
  compared by identity: kind + SHA-256 of its files, not by path or vocabulary size);
- `CHANGE`: changes and takes effect from the resumed step, printed as `resume: KEY OLD → NEW (what happens)`;
- `UNUSED`: not used by a resumed run (printed as well when it differs).

After the load, `apply_new_schedule` makes the new optimizer hyperparameters and LR schedule the ones that run:
the checkpoint contributes the optimizer *state* (moments, Adam step) and the scheduler's step count; the
learning rate, its schedule, betas, eps and weight decay come from this run's config.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from pathlib import Path
from typing import Any

from pretrain.checkpoint.format import CheckpointError, read_saved_config

MATCH, CHANGE, UNUSED = "must match", "changes and takes effect", "not used on resume"
TOKENIZER_KEYS = ("data.tokenizer_type", "data.tokenizer_model", "data.vocab_file", "data.merge_file")
TOKENIZER_STATE = "tokenizer"  # common-state key: TokenizerIdentity.to_dict(), or None for "no tokenizer"

_MODEL_IDENTITY = (
    "family", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "vocab_size", "normalization", "layernorm_epsilon", "gated_linear_unit", "activation",
    "position_embedding_type", "rotary_base", "rotary_percent", "rope_scaling", "rope_scaling_factor",
    "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings",
    "share_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "qk_layernorm", "sliding_window",
    "window_attn_skip_freq", "softmax_type", "glu_linear_offset", "activation_func_clamp_value",
    "yarn_correction_range_round_to_int",
    "apply_residual_connection_post_layernorm", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
    "moe_router_score_function", "moe_router_pre_softmax",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim", "moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_router_num_groups",
    "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias", "mtp_num_layers",
)
_MODEL_TRAINING = (
    "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by", "hidden_dropout", "attention_dropout",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "bias_activation_fusion", "transformer_impl", "fp8", "fp8_param_gather", "moe_router_dtype",
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor",
    "moe_token_drop_policy", "moe_pad_expert_input_to_capacity", "moe_token_dispatcher_type", "moe_grouped_gemm",
    "moe_router_bias_update_rate", "mtp_loss_scaling_factor", "fp8_recipe",
)
_SCHEDULE = ("lr", "min_lr", "warmup_steps", "decay_style", "decay_steps", "wsd_decay_steps", "lr_wsd_decay_style")
_ADAM = ("weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")
_DDP = ("overlap_grad_reduce", "overlap_param_gather", "grad_reduce_in_fp32")


def _group(cls: str, how: str, section: str, names) -> dict[str, tuple[str, str]]:
    return {f"{section}.{name}": (cls, how) for name in names}


# (class, what happens on resume) for every leaf of the config tree; docs/checkpoints.md "Resuming" shows it.
FIELDS: dict[str, tuple[str, str]] = {
    **_group(MATCH, "the model's identity: a resumed run trains the same model", "model", _MODEL_IDENTITY),
    "model.preset": (UNUSED, "its fields are compared one by one"),
    "model.init_method_std": (UNUSED, "the weights come from the checkpoint"),
    **_group(CHANGE, "from the resumed step", "model", _MODEL_TRAINING),
    **_group(CHANGE, "the checkpoint is resharded to the new layout (RNG states restored only for the same "
             "layout)", "parallel", ("tensor", "pipeline", "virtual_pipeline", "context", "expert",
                                     "expert_tensor", "sequence_parallel",
                                     "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                                     "pipeline_layout", "account_for_embedding_in_pipeline_split",
                                     "account_for_loss_in_pipeline_split")),
    **_group(CHANGE, "from the resumed step", "parallel", ("tp_comm_overlap", "batch_p2p_comm",
                                                              "cp_comm_type")),
    **_group(MATCH, "the tokenizer, compared by identity (kind and SHA-256 of its files), not by path",
             "data", [k.split(".")[1] for k in TOKENIZER_KEYS]),
    **_group(CHANGE, "training reads the new data from consumed_samples on", "data",
             ("mock", "blend", "train_blend", "valid_blend", "test_blend", "split")),
    **_group(CHANGE, "from the resumed step", "data", ("num_workers", "cache_dir", "eod_mask_loss",
                                                        "reset_position_ids", "reset_attention_mask",
                                                        "allow_tokenizer_mismatch")),
    **_group(CHANGE, "the LR schedule is re-derived from this config at the resumed step", "optimizer", _SCHEDULE),
    **_group(CHANGE, "this config's value replaces the checkpoint's from the resumed step", "optimizer", _ADAM),
    "optimizer.distributed": (CHANGE, "the optimizer state is converted to this run's optimizer"),
    "optimizer.name": (CHANGE, "only with checkpoint.load_optimizer=false: the new optimizer starts fresh from the "
                       "checkpoint's weights (AdamW's moments are not Muon's momentum); refused otherwise"),
    **_group(CHANGE, "this config's value replaces the checkpoint's from the resumed step", "optimizer.muon",
             ("momentum", "nesterov", "num_ns_steps", "coefficient_type", "scale_mode", "extra_scale_factor",
              "split_qkv", "tp_mode", "fp32_matmul_prec", "qk_clip", "qk_clip_threshold", "qk_clip_alpha")),
    "optimizer.muon.layer_wise": (CHANGE, "Muon's momentum is loaded into this run's optimizer (whole matrices "
                                  "either way)"),
    "optimizer.fsdp": (CHANGE, "the checkpoint is loaded across formats (torch_dist ↔ fsdp_dtensor, "
                       "pretrain/checkpoint/cross_format.py) and saved in this run's from then on"),
    "optimizer.fsdp_sharding": (CHANGE, "fsdp_dtensor holds the same global tensors for every strategy: the "
                                "state is resharded to the new one"),
    **_group(CHANGE, "from the resumed step", "optimizer", _DDP),
    "train.steps": (CHANGE, "the run ends there; with optimizer.decay_steps null the LR decay is re-derived over it"),
    "train.global_batch_size": (CHANGE, "consumed_samples continues: the next step reads the samples after it"),
    "train.micro_batch_size": (CHANGE, "the same global batch in other microbatches"),
    "train.seed": (CHANGE, "the data order from consumed_samples on and, after a reshard, the RNG"),
    "train.precision": (MATCH, "16-bit and fp32 runs keep different optimizer state"),
    **_group(CHANGE, "from the resumed step", "train", ("eval_interval", "eval_iters", "exit_duration_in_mins",
                                                         "nan_policy", "exit_signal_handler")),
    "train.skip_steps": (CHANGE, "the listed steps still ahead are consumed, not trained"),
    **_group(CHANGE, "from the resumed step", "checkpoint", ("interval", "dir", "keep_last", "async_save",
                                                              "save_optimizer", "load_optimizer", "save_at_end")),
    "checkpoint.pretrained": (UNUSED, "the run resumes from its own checkpoint"),
    **_group(CHANGE, "from the resumed step", "logging", ("log_interval", "tensorboard", "timing_interval",
                                                            "straggler_threshold")),
    **_group(CHANGE, "from the resumed step", "logging.wandb", ("project", "entity", "name", "mode")),
    **_group(CHANGE, "from the resumed step", "logging.profile", ("start_step", "end_step", "ranks")),
    **_group(CHANGE, "from the resumed step", "run", ("dir", "name", "allow_untested_versions")),
    **_group(CHANGE, "from the resumed step (speed settings: the model's math is the same)", "performance",
             ("moe_flex_dispatcher_backend", "cuda_graph_impl", "cuda_graph_scope", "cpu_offloading_num_layers",
              "fine_grained_activation_offloading", "offload_modules", "overlap_moe_expert_parallel_comm",
              "moe_shared_expert_overlap", "cross_entropy_fusion_impl")),
    "performance.fp4_recipe": (CHANGE, "from the resumed step: the GEMMs' numerics change, the state does not"),
    **_group(CHANGE, "from the resumed step (the spike maximum comes from the checkpoint)", "rerun",
             ("mode", "spike_factor", "spike_window", "on_transient")),
    **_group(CHANGE, "from the resumed step", "hang", ("enabled", "factor", "floor_s", "long_s",
                                                        "process_group_timeout_s")),
    **_group(CHANGE, "from the resumed step (injected faults: tests only)", "testing",
             ("nan_step", "nan_rank", "nan_times", "spike_step", "spike_rank", "spike_scale", "spike_times",
              "hang_step", "hang_rank", "hang_how", "slow_rank", "slow_s")),
}


def config_fields(cls: type | None = None, prefix: str = "") -> list[str]:
    """Dotted names of every leaf field of the config tree (`Config` by default)."""
    if cls is None:
        from pretrain.config import Config

        cls = Config
    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += config_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: Any) -> str:
    """A value as YAML writes it (null, true, 0.001, [1.0, a])."""
    import yaml

    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


# --------------------------------------------------------------------------------------------------
# The tokenizer's identity
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _identity(tokenizer_type: str | None, model: str | None, vocab: str | None, merges: str | None):
    from pretrain.tokenizer.embedded import with_embedded
    from pretrain.tokenizer.identity import describe_tokenizer

    if tokenizer_type is None:
        return None
    ttype, model, vocab, merges, _ = with_embedded(tokenizer_type, model, vocab, merges)
    return describe_tokenizer(ttype, model, vocab, merges)


def _run_identity(cfg):
    """The identity of the tokenizer `cfg` trains with (`pretrain.data.check.run_tokenizer_identity`: the null
    tokenizer of a mock run without files, else its files)."""
    from pretrain.data.check import run_tokenizer_identity, uses_null_tokenizer

    if uses_null_tokenizer(cfg.data):
        return run_tokenizer_identity(cfg)
    d = cfg.data
    return _identity(d.tokenizer_type, d.tokenizer_model, d.vocab_file, d.merge_file)


def _saved_identity(common: dict, saved: dict[str, Any]):
    """(identity or None, note): the checkpoint's recorded tokenizer, else the one its run_config.yaml names."""
    from pretrain.tokenizer.identity import TokenizerIdentity

    if TOKENIZER_STATE in common:
        record = common[TOKENIZER_STATE]
        return (None if record is None else TokenizerIdentity.from_dict(record)), None
    args = [saved.get(k) for k in TOKENIZER_KEYS]
    try:
        return _identity(*args), ("the checkpoint records no tokenizer identity (written before they were "
                                  "recorded): compared with the tokenizer its run_config.yaml names")
    except Exception:  # noqa: BLE001 - its files are gone: compare the keys
        return None, ("the checkpoint records no tokenizer identity and the tokenizer files its run_config.yaml "
                      "names are unreadable: compared the data.tokenizer_* keys")


# --------------------------------------------------------------------------------------------------
# The check before loading
# --------------------------------------------------------------------------------------------------


def _resolved_model(model: dict[str, Any], vocab: int | None) -> dict[str, Any]:
    """Model fields with their null defaults applied (null ffn_hidden_size = 4 × hidden, …; vocab = tokenizer's)."""
    from types import SimpleNamespace

    from pretrain.config import ModelConfig
    from pretrain.layout import model_shape

    values = {f.name: model.get(f.name, f.default) for f in dataclasses.fields(ModelConfig)}
    shape = model_shape(SimpleNamespace(**values))
    return {**values, "ffn_hidden_size": shape.ffn_hidden_size, "num_query_groups": shape.num_query_groups,
            "kv_channels": shape.head_dim, "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
            "vocab_size": values["vocab_size"] or vocab}


def check_resume(cfg, path: Path, common: dict, tokenizer=None) -> list[str]:
    """Compare the checkpoint at `path` (its run_config.yaml and recorded tokenizer) with `cfg` and its tokenizer
    (`tokenizer`: the run's `TokenizerPlan`; None: resolved here from `cfg`, for callers without a plan).

    Returns the lines to print (`resume: KEY OLD → NEW (what happens)` and notes); raises CheckpointError naming
    every must-match key that differs.
    """
    from pretrain.config import Config

    saved_tree = read_saved_config(path)
    defaults = _flatten(Config().to_dict())
    saved = {**defaults, **_flatten(saved_tree)}
    new = _flatten(cfg.to_dict())
    lines = [f"resume: {key} in the checkpoint's run_config.yaml is no longer a config key (ignored)"
             for key in _flatten(saved_tree) if key not in FIELDS]
    old_tok, note = _saved_identity(common, saved)
    new_tok = tokenizer.identity if tokenizer is not None else _run_identity(cfg)
    if note:
        lines.append(f"resume: note: {note}")
    new_vocab = new_tok.vocab_size if new_tok else None
    old_model = _resolved_model({k[6:]: v for k, v in saved.items() if k.startswith("model.")},
                                old_tok.vocab_size if old_tok else new_vocab)
    new_model = _resolved_model({k[6:]: v for k, v in new.items() if k.startswith("model.")}, new_vocab)
    refused: list[str] = []
    for key, (cls, how) in FIELDS.items():
        old, now = saved.get(key), new[key]
        if key in TOKENIZER_KEYS:
            continue
        if cls == MATCH and key.startswith("model."):
            old, now = old_model[key[6:]], new_model[key[6:]]
        if old == now:
            continue
        if cls == MATCH:
            refused.append(f"{key} {_show(old)} → {_show(now)}")
        else:
            lines.append(f"resume: {key} {_show(old)} → {_show(now)} ({how})")
    tokenizer_changed = [f"{k} {_show(saved.get(k))} → {_show(new[k])}" for k in TOKENIZER_KEYS
                         if saved.get(k) != new[k]]
    if old_tok is not None and new_tok is not None:
        if old_tok.sha256 != new_tok.sha256:
            raise CheckpointError(
                f"{path}: cannot resume with another tokenizer: the checkpoint was trained with {old_tok.describe()}, "
                f"this run's is {new_tok.describe()} ({', '.join(tokenizer_changed) or 'same keys, other files'}); "
                f"the embedding rows belong to the checkpoint's tokenizer. Use it, or start a new run.dir with "
                f"checkpoint.pretrained={path}")
        lines += [f"resume: {c} (the same tokenizer: {new_tok.describe()})" for c in tokenizer_changed]
    else:  # not both known: the keys must match
        refused += tokenizer_changed
    _optimizer_switch(cfg, path, saved.get("optimizer.name"), new["optimizer.name"])
    if refused:
        raise CheckpointError(
            f"{path}: cannot resume with {', '.join(refused)}: these must match the checkpoint (the model's identity "
            f"and its tokenizer; docs/checkpoints.md, Resuming). To train a changed model from these weights, start "
            f"a new run.dir with checkpoint.pretrained={path}")
    return lines


def _optimizer_switch(cfg, path: Path, old: str | None, now: str) -> None:
    """AdamW ↔ Muon on resume: their states differ, so only a fresh optimizer (checkpoint.load_optimizer=false,
    recorded in config.yaml as this run's choice) may switch."""
    if old == now or not cfg.checkpoint.load_optimizer:
        return
    raise CheckpointError(
        f"{path}: cannot resume with optimizer.name {_show(old)} → {_show(now)} and its optimizer state: the "
        f"checkpoint holds {old}'s state, {now} keeps another (AdamW: two moments per parameter; Muon: one momentum "
        f"per matrix). Set checkpoint.load_optimizer=false to start {now} fresh from the checkpoint's weights, or "
        f"keep optimizer.name={old}")


# --------------------------------------------------------------------------------------------------
# After loading: this config's optimizer hyperparameters and LR schedule
# --------------------------------------------------------------------------------------------------

_KEPT_FROM_CHECKPOINT = ("params", "step")  # per-group values that are optimizer state, not configuration


def hyperparameters(optimizer) -> list[dict]:
    """The freshly built optimizer's param-group settings (from this config), to restore after a load."""
    return [{k: v for k, v in g.items() if k not in _KEPT_FROM_CHECKPOINT} for g in optimizer.param_groups]


def apply_new_schedule(optimizer, scheduler, fresh_groups: list[dict] | None, num_steps: int) -> None:
    """Put this config's hyperparameters back into the loaded param groups (torch's `load_state_dict` replaces
    them with the checkpoint's: lr, max_lr/min_lr, betas, eps, weight decay) and set the LR schedule, built
    from this config, at the checkpoint's step count."""
    groups = optimizer.param_groups
    if fresh_groups is not None:
        if len(fresh_groups) != len(groups):
            raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this model's "
                                  f"{len(fresh_groups)}")
        for group, fresh in zip(groups, fresh_groups):
            group.update(fresh)
    scheduler.num_steps = 0
    scheduler.step(increment=num_steps)
