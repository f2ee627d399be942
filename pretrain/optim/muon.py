"""`optimizer.name: muon`: Megatron-Core's Muon (TensorParallelMuon) and AdamW, split as Megatron-Core splits them:
every 2-D weight to Muon (attention and MLP projections, expert weights, the router's weight) except the embedding
and output layer; those and every 1-D tensor (norms, biases, the MoE expert bias) to AdamW. Built by Megatron-Core
(`pretrain.compat.muon.build_muon`).

Data parallel: `optimizer.muon.layer_wise=true` selects Megatron-Core's LayerWiseDistributedOptimizer (each DP rank
updates whole matrices, then all-gathers them; 16-bit runs only, `LAYER_WISE_FP32` in `pretrain.compat.muon`);
Megatron-Core refuses Muon inside the classic distributed optimizer
(`optimizer.distributed`) and with Megatron-FSDP (`pretrain.rules.optimizer`). QK-clip (`optimizer.muon.qk_clip`)
is Megatron-Core's `clip_qk` after each optimizer step (`after_step`).
"""

from __future__ import annotations

from typing import Any

from pretrain.config import OptimizerConfig
from pretrain.layout import Layout


def muon_optimizer_config(o: OptimizerConfig, config):
    """Megatron-Core's OptimizerConfig `config` (this run's AdamW settings, for the parameters Muon does not take)
    with the optimizer.muon.* keys under Megatron-Core's `muon_*` names (validation refuses the classic
    distributed optimizer with Muon)."""
    from model_providers.core.knobs import OPT, mcore_kwargs
    from pretrain.compat.muon import muon_fields

    for name, value in muon_fields(mcore_kwargs(o.muon, OPT)).items():
        setattr(config, name, value)
    return config


def build_muon_optimizer(o: OptimizerConfig, model: list, layout: Layout, config, log=None):
    """Muon + AdamW over the DDP-wrapped model chunks from Megatron-Core's OptimizerConfig `config`
    (`model_providers.core.optimizer_config`) and the optimizer section `o`; prints one line with what each optimizer
    got."""
    from pretrain.compat.muon import build_muon

    layer_wise = o.muon.layer_wise
    optimizer = build_muon(muon_optimizer_config(o, config), model, layer_wise=layer_wise)
    counts = parameter_split(optimizer, layer_wise=layer_wise and layout.dp > 1)
    if log is not None:
        log(describe_split(counts, o))
    return optimizer


def _inner(optimizer) -> Any:
    """The torch optimizer inside Megatron's wrappers (FP32Optimizer, Float16Optimizer...)."""
    while hasattr(optimizer, "optimizer") and not hasattr(optimizer, "chained_optimizers"):
        optimizer = optimizer.optimizer
    return optimizer


def is_muon(optimizer) -> bool:
    """Whether a chained (wrapped) optimizer is Megatron-Core's Muon."""
    return "Muon" in type(_inner(optimizer)).__name__


def parameter_split(optimizer, layer_wise: bool) -> dict[str, list[int]]:
    """{"muon"|"adamw": [tensors, elements]} of this model-parallel rank's shard. Under the layer-wise optimizer
    each DP rank holds a disjoint part of the tensors: summed over the (expert) data-parallel group."""
    import torch

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    dense = torch.zeros(4, dtype=torch.float64)  # muon tensors, muon elements, adamw tensors, adamw elements
    expert = torch.zeros(4, dtype=torch.float64)
    for opt in chained:
        base = 0 if is_muon(opt) else 2
        for group in opt.param_groups:
            into = expert if group.get("is_expert_parallel", False) else dense
            for p in group["params"]:
                into[base] += 1
                into[base + 1] += p.numel()
    if layer_wise and torch.distributed.is_initialized():
        from megatron.core import parallel_state as ps

        torch.distributed.all_reduce(dense, group=ps.get_data_parallel_group(with_context_parallel=True))
        torch.distributed.all_reduce(expert, group=ps.get_expert_data_parallel_group())
    total = (dense + expert).long().tolist()
    return {"muon": total[:2], "adamw": total[2:]}


def describe_split(counts: dict[str, list[int]], o: OptimizerConfig) -> str:
    """The one start-up line: how many parameters each optimizer got (`o`: the optimizer section)."""
    m = o.muon
    muon_n, muon_e = counts["muon"]
    adam_n, adam_e = counts["adamw"]
    layer_wise = "; layer-wise distributed over DP" if m.layer_wise else ""
    return (f"[pretrain] optimizer muon: {muon_e:,} parameters in {muon_n} matrices (Muon: momentum {m.momentum}, "
            f"{m.num_ns_steps} Newton-Schulz steps, scale {m.scale_mode} x {m.extra_scale_factor}), "
            f"{adam_e:,} in {adam_n} tensors to AdamW (embeddings, output layer, 1-D: norms, biases, expert bias)"
            f"{layer_wise}; rank 0's model shard")


def after_step(o: OptimizerConfig, model: list) -> float | None:
    """QK-clip after an optimizer step (optimizer.muon.qk_clip): Megatron-Core's `clip_qk` rescales the query and
    key weights of every head whose max attention logit passed the threshold; returns the max logit (`o`: the
    optimizer section)."""
    if o.name != "muon" or not o.muon.qk_clip:
        return None
    from types import SimpleNamespace

    from megatron.core.optimizer.qk_clip import clip_qk
    from megatron.core.utils import unwrap_model

    # clip_qk reads chunk.module.module.decoder: DDP(Float16Module(GPTModel)) in 16-bit runs; fp32 runs have no
    # Float16Module, so each chunk is handed over in that shape
    return clip_qk([SimpleNamespace(module=SimpleNamespace(module=unwrap_model(c))) for c in model])
