"""Per-step MoE and Multi-Token Prediction metrics: the routers' auxiliary losses, the load of every expert, the
expert bias of aux-loss-free balancing, and the MTP loss.

    moe = MoEMetrics.attach(chunks)            # None for a dense model without MTP
    ... one training step ...
    record.update(moe.step(num_microbatches))  # collective: every rank calls it

Auxiliary losses come from Megatron-Core's layer-wise tracker (`save_to_aux_losses_tracker`, reduced with
`reduce_aux_losses_tracker_across_ranks`): each is the coefficient-free loss averaged over MoE layers and
microbatches (Megatron-LM's `track_moe_metrics` convention). Expert load is counted by a forward hook on every
router: tokens routed to each expert of each layer (after capacity dropping), summed over the whole global batch
(every token is routed on exactly one rank: sequence parallel splits tokens across TP, data across DP, layers
across PP, so a world-wide sum counts each once).

Keys: `moe_<loss name>` (e.g. `moe_load_balancing_loss`, `moe_z_loss`), `moe_tokens_per_expert`
([layer][expert] counts), `moe_max_over_mean_load` (the most loaded expert over the mean, worst layer) and
`moe_max_over_mean_load_per_layer`. Layers are the decoder's then the MTP layers' (a dense layer's row is zeros).

With `moe_router_enable_expert_bias` (DeepSeek's aux-loss-free balancing; Megatron-Core updates the bias in
`finalize_model_grads`, once per step, by ± the update rate toward the mean load): `moe_expert_bias`
([layer][expert], null for a dense layer, after this step's update), `moe_expert_bias_min`, `moe_expert_bias_max`
and `moe_expert_bias_range` (the widest max − min of a layer). With MTP (`mtp_num_layers`): `mtp_loss` (mean over
the MTP layers of Megatron-Core's per-microbatch MTP loss, averaged over microbatches and data-parallel ranks, before
`mtp_loss_scaling_factor`) and `mtp_loss_per_layer`, on the last pipeline stage (where the loss is).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist


class MoEMetrics:
    """Counts expert load through router hooks and reads the aux-loss and MTP trackers once per step."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device, moe_layers: int = 0,
                 mtp_layers: int = 0):
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.handles: list[Any] = []
        self.moe_layers = moe_layers or num_layers  # decoder MoE layers + MTP layers: the aux losses' mean
        self.mtp_layers = mtp_layers
        self.biased: list[Any] = []  # this rank's routers with an expert bias
        self.bias_enabled = False  # the model's routers have an expert bias (on some stage)
        self.aux_names: list[str] | None = None  # every rank's tracked aux-loss names, gathered at the first step
        self.tracker_layers = num_layers  # Megatron-Core's tracker entries: decoder layers + MTP depths

    @classmethod
    def attach(cls, chunks: list) -> MoEMetrics | None:
        """Hook every router of this rank's model chunks; None when the model has neither experts nor MTP."""
        from megatron.core.transformer.moe.router import Router

        from model_providers.core.specs import moe_layer_pattern

        config = chunks[0].config
        mtp = config.mtp_num_layers or 0
        if not config.num_moe_experts and not mtp:
            return None
        device = next(chunks[0].parameters()).device
        _forget_earlier_runs()
        decoder, depth = _hybrid_patterns(chunks[0])
        if decoder is None:  # GPTModel: moe_layer_freq places the MoE layers, an MTP layer is the last layer's kind
            moe_layers, rows = sum(moe_layer_pattern(config)) + mtp, config.num_layers + mtp
        else:  # a hybrid model: its patterns do, and an MTP depth has a row per layer of its pattern
            moe_layers, rows = decoder.count("E") + mtp * depth.count("E"), config.num_layers + mtp * len(depth)
        metrics = cls(rows, config.num_moe_experts or 0, device, moe_layers if config.num_moe_experts else 0, mtp)
        metrics.tracker_layers = config.num_layers + mtp  # the size of Megatron-Core's aux-loss tracker entries
        metrics.bias_enabled = bool(getattr(config, "moe_router_enable_expert_bias", False))
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, Router):
                    hybrid_mtp = _HYBRID_MTP.search(name)
                    if hybrid_mtp:  # numbered within its depth (like a decoder layer): its row after the decoder's
                        d, j = int(hybrid_mtp.group(1)), int(hybrid_mtp.group(2))
                        module.metrics_row = config.num_layers + d * len(depth or "") + j
                    metrics.handles.append(module.register_forward_hook(metrics._count))
                    if getattr(module, "expert_bias", None) is not None:
                        metrics.biased.append(module)
        return metrics

    def _count(self, router, _inputs, output) -> None:
        # Training forwards only; with activation recompute the router runs again in backward under grad
        # (its first run, inside the checkpoint, is without grad), so every token is counted once.
        if not (router.training and torch.is_grad_enabled()) or router.layer_number is None:
            return
        _probs, routing_map = output
        self.counts[_row(router)] += routing_map.sum(dim=0).to(self.counts.dtype)

    def step(self, num_microbatches: int) -> dict:
        """This step's metrics on every rank (collective); resets the counts and the trackers."""
        record = mtp_losses(num_microbatches) if self.mtp_layers else {}
        if not self.counts.shape[1]:  # MTP without experts
            return record
        if self.aux_names is None:
            self.aux_names = tracked_names()
        record.update(aux_losses(num_microbatches, self.moe_layers, self.aux_names, self.tracker_layers,
                                 self.counts.device))
        if self.bias_enabled:
            record.update(expert_bias(self.biased, self.counts.shape, self.counts.device))
        counts = self.counts.clone()
        dist.all_reduce(counts)
        self.counts.zero_()
        routed = counts.sum(dim=1) > 0  # MoE layers that saw tokens
        mean = counts.mean(dim=1).clamp(min=1e-12)
        per_layer = torch.where(routed, counts.max(dim=1).values / mean, torch.zeros_like(mean))
        record["moe_tokens_per_expert"] = [[int(x) for x in row] for row in counts.tolist()]
        record["moe_max_over_mean_load"] = float(per_layer.max()) if bool(routed.any()) else float("nan")
        record["moe_max_over_mean_load_per_layer"] = [round(float(x), 6) for x in per_layer.tolist()]
        return record


def _forget_earlier_runs() -> None:
    """Drop the aux-loss tracker's entries of an earlier run in this process (`clear_aux_losses_tracker` only zeroes
    them): they hold that run's process groups, and a stage without MoE layers would reduce over those."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_moe_metrics_tracker"):  # 0.19+: the tracker object (the legacy dict is a copy)
        moe_utils.get_moe_metrics_tracker()._metrics.clear()
    else:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


def _row(router) -> int:
    """A router's row: the decoder's layers, then the MTP layers. From 0.19 an MTP layer's router numbers itself
    within the MTP block and says so (`is_mtp_layer`; router.py adds `num_layers` for its own trackers); up to 0.18 the
    MTP layer's number already runs on after the decoder's. A hybrid model's MTP routers are numbered within their
    depth and do not say so (0.19's HybridStack): `attach` gives them their row from their module name."""
    row = getattr(router, "metrics_row", None)
    if row is not None:
        return row
    return router.layer_number - 1 + (router.config.num_layers if getattr(router, "is_mtp_layer", False) else 0)


# A hybrid model's MTP router: depth d, layer j of the depth's pattern.
_HYBRID_MTP = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.mtp_model_layer\.layers\.(\d+)\.")


def _hybrid_patterns(chunk) -> tuple[str | None, str]:
    """(decoder pattern, one MTP depth's pattern) of a hybrid model chunk (Megatron-Core's unified pattern on 0.19+:
    `|` segments, `/` depths; `hybrid_override_pattern` before); (None, "") for a GPTModel."""
    while hasattr(chunk, "module"):  # DDP → the model
        chunk = chunk.module
    pattern = getattr(chunk, "hybrid_layer_pattern", None) or getattr(chunk, "hybrid_override_pattern", None)
    if not isinstance(pattern, str):
        return None, ""
    parts = pattern.split("/")
    return parts[0].replace("|", ""), (parts[1] if len(parts) > 1 else "")


def tracked_names() -> list[str]:
    """The aux-loss names any rank's routers tracked this step (collective, once per run). A pipeline stage without
    MoE layers (DeepSeek-V3's dense first layers on stage 0) tracks none, but Megatron-Core's reduction all-reduces
    each name over the pipeline group: every rank must take part for every name."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(get_moe_layer_wise_logging_tracker()))
    return sorted({name for names in gathered for name in names or []})


def aux_losses(num_microbatches: int, num_moe_layers: int, names: list[str], num_layers: int,
               device: torch.device) -> dict:
    """The tracker's losses, reduced across ranks: mean over MoE layers and microbatches (collective)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
        save_to_aux_losses_tracker,
    )

    missing = set(names) - set(get_moe_layer_wise_logging_tracker())
    for name in sorted(missing):  # a stage without MoE layers: a zero entry, so it joins each name's reduction
        save_to_aux_losses_tracker(name, torch.zeros((), device=device), 1, num_layers)
    tracker = get_moe_layer_wise_logging_tracker()
    for entry in tracker.values():
        if entry.get("reduce_group") is None and entry.get("avg_group") is None:
            # The z-loss is a per-rank mean over that rank's tokens: average it over every rank holding tokens.
            entry["avg_group"] = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    reduce_aux_losses_tracker_across_ranks(names)
    out = {f"moe_{name}": float(tracker[name]["values"].sum()) / num_moe_layers / num_microbatches
           for name in names}
    clear_aux_losses_tracker()
    return out


def expert_bias(routers: list, shape: tuple[int, int], device: torch.device) -> dict:
    """Every MoE layer's expert bias on every rank (collective over the world: each layer's bias is contributed once,
    by the router copy on TP/CP/DP rank 0 of its pipeline stage; a stage without MoE layers contributes none)."""
    from megatron.core import parallel_state as ps

    bias = torch.zeros(shape, dtype=torch.float64, device=device)
    held = torch.zeros(shape[0], dtype=torch.float64, device=device)
    group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if dist.get_rank(group) == 0:
        for router in routers:
            bias[_row(router)] = router.expert_bias.detach().to(torch.float64)
            held[_row(router)] = 1.0
    dist.all_reduce(bias)
    dist.all_reduce(held)
    rows = [[float(x) for x in row] if h else None for row, h in zip(bias.tolist(), held.tolist())]
    present = [row for row in rows if row is not None]
    if not present:
        return {}
    return {"moe_expert_bias": rows, "moe_expert_bias_min": min(min(r) for r in present),
            "moe_expert_bias_max": max(max(r) for r in present),
            "moe_expert_bias_range": max(max(r) - min(r) for r in present)}


def mtp_losses(num_microbatches: int) -> dict:
    """Megatron-Core's MTP loss tracker, averaged over data parallel, on the last stage (empty elsewhere); reset.
    Its names: `values` / `reduce_loss_in_tracker` / `clean_loss_in_tracker` up to 0.18, `loss_values` /
    `reduce_metrics_in_tracker` / `clean_metrics_in_tracker` (with prediction counts) from 0.19."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper as Helper

    tracker = Helper.tracker
    new = hasattr(Helper, "reduce_metrics_in_tracker")
    key = "loss_values" if new else "values"
    if key not in tracker:  # not the last pipeline stage (or no training forward yet)
        return {}
    (Helper.reduce_metrics_in_tracker if new else Helper.reduce_loss_in_tracker)()
    per_layer = [float(v) / num_microbatches for v in tracker[key].tolist()]
    (Helper.clean_metrics_in_tracker if new else Helper.clean_loss_in_tracker)()
    return {"mtp_loss": sum(per_layer) / len(per_layer), "mtp_loss_per_layer": per_layer}
