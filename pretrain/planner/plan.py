"""The plan of a config on a cluster, as one JSON-ready dict."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from model_providers.core import hybrid
from model_providers.core.model_plan import model_plan
from pretrain.config import Config
from pretrain.observe.flops import PEAK_TFLOPS, flops_per_token
from pretrain.planner import mamba
from pretrain.planner.activations import layer_terms
from pretrain.planner.census import (
    count_active_parameters,
    count_checkpoint_elements,
    count_mtp_parameters,
    count_parameters,
)
from pretrain.planner.common import (
    DEFAULT_MFU,
    GIB,
    GPU_MEMORY_GIB,
    PlanError,
    cluster_plan,
    fit_limit_gib,
)
from pretrain.planner.context import context_summary
from pretrain.planner.cost import FORMULA, MLA_FORMULA, MOE_FORMULA, cost_model
from pretrain.planner.memory import most_loaded, rank_memory
from pretrain.planner.muon import muon_section
from pretrain.planner.stages import memory_candidates, stage_flops
from pretrain.planner.timing import run_precision


def make_plan(cfg: Config, nodes: int, gpus_per_node: int, gpu: str = "h100", mfu: float = DEFAULT_MFU,
              fused_adam: bool = True, name: str | None = None) -> dict[str, Any]:
    """The plan of `cfg` on nodes × gpus_per_node GPUs, as one JSON-ready dict."""
    if gpu not in PEAK_TFLOPS:
        raise PlanError(f"unknown --gpu '{gpu}' (known: {', '.join(PEAK_TFLOPS)})")
    world = nodes * gpus_per_node
    use_te = cfg.model.transformer_impl != "local"
    lay = cluster_plan(cfg, world, use_te).layout  # the run plan: tokenizer and layout resolved once
    vocab = lay.padded_vocab
    m = cfg.model
    rm = most_loaded(cfg, lay, vocab, fused_adam, gpu)
    stages = [rank_memory(cfg, lay, vocab, r, fused_adam=fused_adam, gpu=gpu) for r in memory_candidates(lay)]
    f_tok = flops_per_token(m, vocab)
    f_step = f_tok * lay.gbs * m.seq_length
    precision = run_precision(m, cfg.performance, lay, gpu)  # the GEMMs': bf16, FP8, MXFP8 or NVFP4
    peak = PEAK_TFLOPS[gpu][precision]
    tok_gpu = peak * 1e12 * mfu / f_tok
    cost = cost_model(cfg, lay, vocab, gpu, gpus_per_node, rm.params, rm.expert_params)
    capacity = GPU_MEMORY_GIB[gpu]
    return {
        "config": name or m.preset or m.family,
        "gpu": gpu,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "world_size": world,
        "layout": {"tensor": lay.tp, "pipeline": lay.pp, "virtual_pipeline": lay.vp if lay.vp > 1 else None,
                   "first_stage_layers": lay.first_stage_layers, "last_stage_layers": lay.last_stage_layers,
                   "pipeline_layout": lay.pipeline_layout, "account_for_embedding": lay.embedding_in_split,
                   "account_for_loss": lay.loss_in_split,
                   "context": lay.cp, "data": lay.dp, "sequence_parallel": lay.sp,
                   "cp_comm_type": cfg.parallel.cp_comm_type if lay.cp > 1 else None,
                   "micro_batch_size": lay.mbs, "global_batch_size": lay.gbs,
                   "num_microbatches": lay.num_microbatches, "distributed_optimizer": lay.distributed,
                   "optimizer": cfg.optimizer.name,
                   "fsdp": lay.fsdp_sharding,
                   "recompute": m.recompute_granularity, "precision": lay.precision, "fp8": m.fp8,
                   "gemm_precision": precision,
                   "transformer_engine": use_te},
        "num_parameters": count_parameters(cfg, vocab, lay=lay),
        "num_active_parameters": count_active_parameters(cfg, vocab, lay=lay),
        "num_mtp_parameters": count_mtp_parameters(cfg, vocab, lay=lay) if m.mtp_num_layers else None,
        # The HF checkpoint's tensors (true vocabulary; expert biases, MTP's stored embedding/head copies).
        "checkpoint_elements": count_checkpoint_elements(cfg, m.vocab_size, lay) if m.vocab_size else None,
        "padded_vocab_size": vocab,
        "flops_per_token": f_tok,
        "stage_flops_per_token": stage_flops(cfg.model, lay, vocab) if lay.pp > 1 else None,
        "flops_per_step": f_step,
        "flops_formula": mamba.FLOPS_FORMULA if hybrid.is_hybrid(m) else FORMULA
        + (f"; {MOE_FORMULA}" if m.num_moe_experts else "")
        + (f"; {MLA_FORMULA}" if m.multi_latent_attention or m.mtp_num_layers else ""),
        "moe": None if not m.num_moe_experts else {
            "experts": m.num_moe_experts, "topk": m.moe_router_topk, "expert_parallel": lay.ep,
            "expert_tensor_parallel": lay.etp, "expert_data_parallel": lay.edp,
            "experts_per_rank": m.num_moe_experts // lay.ep, "expert_parameters_on_rank": rm.expert_params,
            "all_to_all_bytes_per_step": cost.ep_bytes_per_step},
        "fsdp": _fsdp_section(cfg, lay, vocab, rm, gpu),
        "muon": muon_section(cfg, lay, vocab, rm.pp_rank),
        "context_parallel": context_summary(model_plan(cfg), lay, layer_terms),
        "memory_gib": rm.gib(),
        "most_loaded_rank": {"pipeline_stage": rm.pp_rank, "parameters": rm.params,
                             "microbatches_in_flight": sum(rm.in_flight.values())},
        "stages": [{"pipeline_stage": s.pp_rank, **s.gib()} for s in stages],
        "gpu_memory_gib": capacity,
        "fits": rm.total / GIB <= fit_limit_gib(capacity),
        "overflow": _overflow(rm, capacity),
        "fit_limit_gib": round(fit_limit_gib(capacity), 1),
        "margin_gib": round(fit_limit_gib(capacity) - rm.total / GIB, 2),
        "throughput": {"mfu": mfu, "peak_tflops": peak, "tflops_per_gpu": peak * mfu,
                       "tokens_per_s_per_gpu": tok_gpu,
                       "step_time_s": lay.gbs * m.seq_length / (tok_gpu * world)},
        "cost_model": {**asdict(cost), "step_s": cost.step_s,
                       "tokens_per_s_per_gpu": lay.gbs * m.seq_length / (cost.step_s * world),
                       "mfu": f_step / (cost.step_s * world * peak * 1e12)},
    }


def _overflow(rm, capacity: float) -> str | None:
    """Where a plan that does not fit overflows: by how much, on which stage, and its largest term."""
    excess = rm.total / GIB - fit_limit_gib(capacity)
    if excess <= 0:
        return None
    terms = {k: v for k, v in rm.gib().items() if k != "total"}
    largest = max(terms, key=terms.get)
    what = f"{largest} {terms[largest]:.1f} GiB"
    if largest == "activations":
        what += f" ({sum(rm.in_flight.values())} microbatch-chunks in flight)"
    room = capacity - rm.total / GIB  # what the GPU itself has left: the reserve covers it or it does not
    inside = (f" ({room:.1f} GiB under the GPU's {capacity:.1f}: inside the reserve for the CUDA context, NCCL and "
              f"fragmentation)" if room > 0 else "")
    return (f"{excess:.1f} GiB over the {fit_limit_gib(capacity):.1f} GiB limit on pipeline stage {rm.pp_rank}"
            f"{inside}; the largest term: {what}")


def _fsdp_section(cfg: Config, lay, vocab: int, rm, gpu: str) -> dict[str, Any] | None:
    """Megatron-FSDP's part of the plan (`pretrain.planner.fsdp`), None without it."""
    if not lay.fsdp_sharding:
        return None
    from pretrain.planner.fsdp import fsdp_comm_bytes, fsdp_memory

    fm = fsdp_memory(cfg, lay, vocab, rm.pp_rank, gpu)
    dense, expert = fsdp_comm_bytes(cfg.optimizer, lay, rm.params, rm.expert_params)
    return {"sharding": lay.fsdp_sharding, "shard_group": lay.dp * lay.cp,
            "largest_unit_parameters": fm.largest_unit,
            "gathered_params_gib": round(fm.gathered_params / GIB, 3),
            "unsharded_grads_gib": round(fm.unsharded_grads / GIB, 3),
            "comm_bytes_per_step": int(dense + expert)}
