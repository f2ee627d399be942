"""Operations rules: document boundaries, selective recompute, Megatron-FSDP, logging."""

from __future__ import annotations

from pretrain.config import Config
from pretrain.layout import Layout, use_transformer_engine
from pretrain.problems import Report
from pretrain.rules.recompute import recompute_problems


def document_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Document boundaries in packed samples: refuse settings an attention implementation would ignore.

    With data.reset_attention_mask every microbatch is packed sequences (THD: `cu_seqlens` from the EOD positions,
    `pretrain.data.pack_documents`), read by Transformer Engine attention and, with the local spec, by
    `model_providers.core.cp_attention` (Megatron-Core's `DotProductAttention` takes no packed sequences). RoPE
    in `GPTModel` follows the sequence index, not `position_ids` (THD: the index inside each document).
    """
    d, m = cfg.data, cfg.model
    use_te = lay.use_te if lay is not None else use_transformer_engine(m.transformer_impl, te_on_gpu)
    if d.reset_position_ids and m.position_embedding_type == "rope" and not d.reset_attention_mask:
        r.error(("data.reset_position_ids", "model.position_embedding_type"),
                "data.reset_position_ids=true has no effect with RoPE: Megatron-Core's GPTModel rotates by the "
                "sequence index, not by position_ids",
                "also set data.reset_attention_mask=true (then each document sees only its own tokens and RoPE's "
                "relative positions are the restarted ones), or set data.reset_position_ids=false")
    if d.reset_attention_mask:
        attention = "Transformer Engine attention" if use_te else "model_providers/core/cp_attention.py"
        r.notes.append(f"data.reset_attention_mask: each microbatch is packed documents (THD, cu_seqlens from the "
                       f"EOD positions), attended by {attention}")


RECOMPUTE_DEFAULT = ("core_attn",)  # Megatron-Core's default recompute_modules


def recompute_module_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """model.recompute_modules (`pretrain.rules.recompute`)."""
    use_te = lay.use_te if lay is not None else use_transformer_engine(cfg.model.transformer_impl, te_on_gpu)
    for keys, message, fix in recompute_problems(cfg.model, use_te):
        r.error(keys, message, fix)


def fsdp_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
    """Megatron-FSDP (optimizer.fsdp): CUDA only in every supported megatron-core, and no torch_dist checkpoints."""
    from pretrain.compat.mcore import MCORE, megatron_fsdp_sources

    o, c, t = cfg.optimizer, cfg.checkpoint, cfg.train
    if not o.fsdp:
        return
    device_src, dtensor_src = megatron_fsdp_sources
    if lay is not None and not lay.on_gpu:
        r.error("optimizer.fsdp", f"Megatron-FSDP needs CUDA: megatron-core {MCORE} builds its device as "
                "cuda:<current device> and runs its all-gathers and reduce-scatters on torch.cuda.Stream side "
                f"streams ({device_src})", "set optimizer.fsdp=false here (optimizer.distributed=true "
                "shards the optimizer state), or run on a CUDA machine")
    saving = [k for k, on in (("checkpoint.interval", c.interval is not None),
                              ("checkpoint.save_at_end", c.save_at_end),
                              ("train.exit_signal_handler", t.exit_signal_handler),
                              ("train.exit_duration_in_mins", t.exit_duration_in_mins is not None),
                              ("checkpoint.pretrained", c.pretrained is not None)) if on]
    if saving:
        r.error(("optimizer.fsdp", *saving),
                f"Megatron-FSDP state cannot go through the torch_dist checkpoint path: megatron-core {MCORE} "
                "shards Megatron-FSDP optimizer state only in its fsdp_dtensor format (DistributedOptimizer."
                f"sharded_state_dict raises NotImplementedError otherwise, {dtensor_src})",
                "run without checkpoints (checkpoint.interval=null checkpoint.save_at_end=false "
                "train.exit_signal_handler=false train.exit_duration_in_mins=null checkpoint.pretrained=null), or "
                "use optimizer.distributed=true")
    if t.nan_policy == "skip":
        r.error(("optimizer.fsdp", "train.nan_policy"), "train.nan_policy=skip checks DDP's gradient buffers, "
                "which Megatron-FSDP does not have", "set train.nan_policy=stop")


def logging_rules(r: Report, cfg: Config, lay: Layout | None, te_on_gpu: bool) -> None:
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
