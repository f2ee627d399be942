"""Validation rules for Mixture-of-Experts models (`model.num_moe_experts`, `parallel.expert*`), run by
`pretrain.validate` with its report."""

from __future__ import annotations

from typing import Any

from pretrain.config import Config
from pretrain.layout import Layout, expert_layout, model_shape


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def moe_rules(r: Any, cfg: Config, lay: Layout | None) -> None:
    """Expert groups, routing, capacity and the spec; `r`: the `pretrain.validate.Report` (`error`, `world_size`)."""
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
