"""Operations rules: document boundaries, selective recompute, Megatron-FSDP, logging."""

from __future__ import annotations

from pretrain.config import DataConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
from pretrain.config_parse import shown
from pretrain.layout import Layout, use_transformer_engine
from pretrain.problems import Report
from pretrain.rules.recompute import recompute_problems


def document_rules(r: Report, *, model: ModelConfig, data: DataConfig, lay: Layout | None, te_on_gpu: bool) -> None:
    """Document boundaries in packed samples: refuse settings an attention implementation would ignore.

    With data.reset_attention_mask every microbatch is packed sequences (THD: `cu_seqlens` from the EOD positions,
    `pretrain.data.datasets.pack_documents`), read by Transformer Engine attention and, with the local spec, by
    `model_providers.core.cp_attention` (Megatron-Core's `DotProductAttention` takes no packed sequences). RoPE
    in `GPTModel` follows the sequence index, not `position_ids` (THD: the index inside each document).
    """
    d, m = data, model
    use_te = lay.use_te if lay is not None else use_transformer_engine(m.transformer_impl, te_on_gpu)
    if d.reset_position_ids and m.position_embedding_type in ("rope", "yarn") and not d.reset_attention_mask:
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


def recompute_module_rules(r: Report, *, model: ModelConfig, lay: Layout | None, te_on_gpu: bool) -> None:
    """model.recompute_modules (`pretrain.rules.recompute`)."""
    use_te = lay.use_te if lay is not None else use_transformer_engine(model.transformer_impl, te_on_gpu)
    for keys, message, fix in recompute_problems(model, use_te):
        r.error(keys, message, fix)


def fsdp_rules(r: Report, *, parallel: ParallelConfig, optimizer: OptimizerConfig, train: TrainConfig) -> None:
    """Megatron-FSDP (optimizer.fsdp, optimizer.fsdp_sharding): what megatron-core supports of it."""
    from pretrain.compat.mcore import MCORE, megatron_fsdp_limits

    o, p, t = optimizer, parallel, train
    if o.fsdp_sharding is not None and not o.fsdp:
        r.error(("optimizer.fsdp_sharding", "optimizer.fsdp"), f"optimizer.fsdp_sharding={o.fsdp_sharding} is set "
                "but optimizer.fsdp=false, so Megatron-FSDP is off", "set optimizer.fsdp=true (or "
                "optimizer.fsdp_sharding=null)")
    if not o.fsdp:
        return
    if o.distributed:  # both on: which optimizer runs, said once (and config.yaml keeps both, as they ran)
        r.notes.append("optimizer.fsdp=true and optimizer.distributed=true: Megatron-FSDP runs, with its own sharded "
                       "distributed optimizer; optimizer.distributed=true adds nothing to it (false runs the same)")
    src = megatron_fsdp_limits
    at = f"megatron-core {src['release']}: " if src["release"] != str(MCORE) else ""
    sharding = o.fsdp_sharding or "optim_grads_params"
    if sharding == "optim":
        r.error("optimizer.fsdp_sharding", f"optimizer.fsdp_sharding=optim gives wrong gradients in megatron-core "
                f"{MCORE}: Megatron-FSDP's optim strategy reduces them in the last microbatch's backward hook and "
                f"again in finish_grad_sync ({at}{src['optim']}); measured at DP2 on gloo, grad norm 2.07 where the "
                "distributed optimizer has 1.03 (1.62 with overlap_grad_reduce)",
                "use optimizer.fsdp=false optimizer.distributed=true (the distributed optimizer is ZeRO-1), or "
                "optimizer.fsdp_sharding=optim_grads / optim_grads_params")
    if p.pipeline > 1:
        r.error(("optimizer.fsdp", "parallel.pipeline"), f"Megatron-FSDP does not support pipeline parallelism in "
                f"megatron-core {MCORE}: its device mesh is the world rearranged as (DP×CP, EP, TP), with no "
                f"pipeline dimension ({at}{src['mesh']}), so parallel.pipeline={p.pipeline} fails at start-up",
                "set parallel.pipeline=1 (shard over more DP ranks instead), or use optimizer.fsdp=false "
                "optimizer.distributed=true")
    dp_cp = r.world_size // (p.tensor * p.pipeline) if r.world_size % (p.tensor * p.pipeline) == 0 else 0
    if dp_cp == 1 and src["dp1"] != "right":
        measured = "" if src["dp1"] == "wrong" else f" ({MCORE}: not measured, refused as 0.16.1)"
        r.error("optimizer.fsdp", f"Megatron-FSDP with one data-parallel rank gives wrong gradients in megatron-core "
                f"{MCORE}{measured}: its gradient buffer is then not sharded ({at}{src['grad_buffer']}) and the "
                "gradients come out too large — measured on gloo (0.16.1) 2× with one microbatch (grad norm 3.82 where "
                "DDP has 1.91) and 8.8× with four; megatron-core 0.19.2 is right", "run Megatron-FSDP on at least two "
                "data-parallel ranks (it has nothing to shard on one), use optimizer.fsdp=false, or megatron-core 0.19")
    if p.expert > 1 and src["ep_grad_norm"] != "right":
        measured = "" if src["ep_grad_norm"] == "wrong" else f" ({MCORE}: not measured, refused as 0.16.1)"
        r.error(("optimizer.fsdp", "parallel.expert"), f"Megatron-FSDP with expert parallelism reports a wrong "
                f"gradient norm in megatron-core {MCORE}{measured}, so gradient clipping scales the updates wrongly: "
                "on tiny_moe at DP2 × EP2 (gloo, 0.16.1) the step-1 grad norm is 1.0952 where DDP, the distributed "
                "optimizer and Megatron-FSDP at EP1 give 0.9830; megatron-core 0.19.2 gives 0.9830",
                "set parallel.expert=1 (Megatron-FSDP then shards the experts over DP), use optimizer.fsdp=false "
                "optimizer.distributed=true, or megatron-core 0.19")
    if t.nan_policy == "skip":
        r.error(("optimizer.fsdp", "train.nan_policy"), "train.nan_policy=skip checks DDP's gradient buffers, "
                "which Megatron-FSDP does not have", "set train.nan_policy=stop")
    forced = [k for k, on in (("optimizer.overlap_param_gather", sharding == "optim_grads_params"),
                              ("optimizer.overlap_grad_reduce", sharding in ("optim_grads_params", "optim_grads")))
              if on and not getattr(o, k.split(".")[1])]
    if forced:
        r.notes.append(f"optimizer.fsdp_sharding={sharding}: Megatron-FSDP turns {' and '.join(forced)} on itself "
                       f"({at}{src['overlap']})")


def logging_rules(r: Report, *, train: TrainConfig, logging: LoggingConfig) -> None:
    """Weights & Biases, the profiler window and per-rank timing."""
    lg, steps = logging, train.steps
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
        if p.memory:
            r.error(("logging.profile.memory", "logging.profile.start_step"),
                    "logging.profile.memory=true records allocations inside a profile window, and "
                    "logging.profile.start_step is null (no window)", "set logging.profile.start_step")
    else:
        end = p.end_step if p.end_step is not None else p.start_step
        if 1 <= end < p.start_step:  # a step below 1: the range rule's
            r.error(("logging.profile.start_step", "logging.profile.end_step"),
                    f"profile window {p.start_step}..{end} is empty",
                    "use 1 <= start_step <= end_step")
        elif end > steps:
            r.error(("logging.profile.end_step", "train.steps"),
                    f"profile window ends at step {end}, after the last step (train.steps={steps})",
                    f"end the window by step {steps}")
        bad = [x for x in p.ranks if not 0 <= x < r.world_size]
        if len(p.ranks) > len(set(p.ranks)):
            r.error("logging.profile.ranks", f"logging.profile.ranks lists {len(p.ranks):,} ranks, "
                    f"{len(p.ranks) - len(set(p.ranks)):,} of them more than once", "list each rank once")
        elif not p.ranks or bad:
            r.error("logging.profile.ranks", f"logging.profile.ranks={shown(p.ranks)} must name ranks of the job "
                    f"(0..{r.world_size - 1})", "e.g. logging.profile.ranks=[0]")
