"""Per-step MoE metrics: the routers' auxiliary losses and the load of every expert.

    moe = MoEMetrics.attach(chunks)            # None for a dense model
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
`moe_max_over_mean_load_per_layer`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class MoEMetrics:
    """Counts expert load through router hooks and reads the aux-loss tracker once per step."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device):
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        self.handles: list[Any] = []

    @classmethod
    def attach(cls, chunks: list) -> MoEMetrics | None:
        """Hook every router of this rank's model chunks; None when the model has no experts."""
        from megatron.core.transformer.moe.router import Router

        config = chunks[0].config
        if not config.num_moe_experts:
            return None
        device = next(chunks[0].parameters()).device
        metrics = cls(config.num_layers, config.num_moe_experts, device)
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, Router):
                    metrics.handles.append(module.register_forward_hook(metrics._count))
        return metrics

    def _count(self, router, _inputs, output) -> None:
        # Training forwards only; with activation recompute the router runs again in backward under grad
        # (its first run, inside the checkpoint, is without grad), so every token is counted once.
        if not (router.training and torch.is_grad_enabled()) or router.layer_number is None:
            return
        _probs, routing_map = output
        self.counts[router.layer_number - 1] += routing_map.sum(dim=0).to(self.counts.dtype)

    def step(self, num_microbatches: int) -> dict:
        """This step's metrics on every rank (collective); resets the counts and the tracker."""
        record = aux_losses(num_microbatches, self.counts.shape[0])
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


def aux_losses(num_microbatches: int, num_moe_layers: int) -> dict:
    """The tracker's losses, reduced across ranks: mean over MoE layers and microbatches (collective)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    for entry in tracker.values():
        if entry.get("reduce_group") is None and entry.get("avg_group") is None:
            # The z-loss is a per-rank mean over that rank's tokens: average it over every rank holding tokens.
            entry["avg_group"] = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    names = sorted(tracker)
    reduce_aux_losses_tracker_across_ranks(names)
    out = {f"moe_{name}": float(tracker[name]["values"].sum()) / num_moe_layers / num_microbatches
           for name in names}
    clear_aux_losses_tracker()
    return out
