"""`--search`: every layout that passes the validator and fits, ranked by the cost model."""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any

from pretrain.config import Config
from pretrain.observe.flops import PEAK_TFLOPS
from pretrain.planner.common import GIB, GPU_MEMORY_GIB, PlanError, checked_layout, fit_limit_gib
from pretrain.planner.cost import cost_model
from pretrain.planner.memory import most_loaded
from pretrain.planner.placements import Placement, placements


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def uneven_split(num_layers: int, pp: int, vp: int) -> tuple[int | None, int | None] | None:
    """Layers of the first and last pipeline stage when `num_layers` does not split evenly over pp × vp: the most
    balanced Megatron-Core allows (each a multiple of vp; the rest even over the middle stages), the last stage (loss,
    MTP) no larger than the first. (None, None): even already; None: no split."""
    if num_layers % (pp * vp) == 0:
        return None, None
    if pp < 2:
        return None
    best = None
    for first in range(vp, num_layers, vp):
        for last in range(vp, num_layers - first + 1, vp):
            middle, stages = num_layers - first - last, pp - 2
            if bool(middle) != bool(stages) or (stages and (middle % stages or (middle // stages) % vp)):
                continue
            key = (max(first, last, middle // stages if stages else 0), last > first, abs(first - last))
            if best is None or key < best[0]:
                best = (key, first, last)
    return None if best is None else (best[1], best[2])


def _placements(m: Any, pp: int, vp: int) -> list[Placement]:
    """The placements tried on pp × vp stages (`pretrain.planner.placements`)."""
    return placements(m.num_layers, pp, vp, bool(m.mtp_num_layers), uneven_split(m.num_layers, pp, vp))


def search(cfg: Config, nodes: int, gpus_per_node: int, gpu: str = "h100", top: int = 5,
           fused_adam: bool = True) -> list[dict[str, Any]]:
    """Every layout that passes the validator and fits in memory, best first by the cost model."""
    if gpu not in PEAK_TFLOPS:
        raise PlanError(f"unknown --gpu '{gpu}' (known: {', '.join(PEAK_TFLOPS)})")
    world = nodes * gpus_per_node
    m = cfg.model
    use_te = m.transformer_impl != "local"
    from pretrain.run_plan import resolve_tokenizer

    tokenizer = resolve_tokenizer(cfg)  # once; each candidate's layout is the one its validation derives
    results = []
    tps = [t for t in _divisors(gpus_per_node) if t <= 8]
    cps = [1, 2, 4, 8] if use_te else [1]
    recomputes: list[tuple[str | None, str | None, int | None]] = [
        (None, None, None), ("selective", None, None), ("full", "uniform", 1)]
    # MoE: expert parallel sizes dividing the experts, experts whole (expert TP 1): within a node (the token
    # all-to-all on NVLink) or over whole nodes; with more than 128 experts (DeepSeek-V3, Kimi K2) only across
    # nodes, whole nodes (EP32/64 as published; their weights do not fit in fewer GPUs; the cost model's EP term
    # counts the network).
    eps: list[int | None] = [None]
    if m.num_moe_experts and m.num_moe_experts > 128:
        eps = [e for e in _divisors(m.num_moe_experts) if e > gpus_per_node and e % gpus_per_node == 0 and e <= world]
    elif m.num_moe_experts:  # within a node, or whole nodes (the cost model counts the network's all-to-all)
        eps = [e for e in _divisors(m.num_moe_experts) if e <= gpus_per_node or (e % gpus_per_node == 0 and e <= world)]
    for tp in tps:
        for cp in cps:
            # Even splits; and, for the usual 2–16 stages that do not divide the layers, uneven ones.
            for pp in sorted(set(_divisors(m.num_layers)) | {q for q in (2, 4, 8, 16) if q < m.num_layers}):
                if world % (tp * cp * pp):
                    continue
                if m.num_layers % pp == 0:
                    vps = [None] + ([v for v in _divisors(m.num_layers // pp) if 2 <= v <= 10] if pp > 1 else [])
                else:
                    vps = [None] + [v for v in range(2, 11) if _placements(m, pp, v)]
                # Megatron-FSDP (ZeRO-3) as well as the distributed optimizer; it has no pipeline dimension.
                fsdps = (False, True) if pp == 1 else (False,)
                comms = ("p2p", "a2a") if cp > 1 else (cfg.parallel.cp_comm_type,)
                for vp, ep, mbs, fsdp, comm, place, (gran, method, num) in (
                        (v, e, b, f, x, pl, r) for v in vps for e in eps for b in (1, 2, 4) for f in fsdps
                        for x in comms for pl in _placements(m, pp, v or 1) for r in recomputes):
                    c = copy.deepcopy(cfg)
                    c.parallel.tensor, c.parallel.pipeline, c.parallel.context = tp, pp, cp
                    c.parallel.cp_comm_type = comm
                    if ep is not None:
                        c.parallel.expert, c.parallel.expert_tensor = ep, 1
                    c.parallel.virtual_pipeline = vp
                    c.parallel.num_layers_in_first_pipeline_stage = place.first
                    c.parallel.num_layers_in_last_pipeline_stage = place.last
                    c.parallel.pipeline_layout = place.layout
                    c.parallel.account_for_embedding_in_pipeline_split = place.embedding_and_loss
                    c.parallel.account_for_loss_in_pipeline_split = place.embedding_and_loss
                    c.parallel.sequence_parallel = tp > 1
                    # TP communication overlap as the config asks, where it applies (TP > 1, with SP)
                    c.parallel.tp_comm_overlap = cfg.parallel.tp_comm_overlap and tp > 1
                    c.train.micro_batch_size = mbs
                    c.optimizer.distributed, c.optimizer.fsdp = not fsdp, fsdp
                    c.model.recompute_granularity = gran
                    c.model.recompute_method, c.model.recompute_num_layers = method, num
                    if gran != "selective":  # the config's modules (or Megatron-Core's default) when selective
                        c.model.recompute_modules = None
                    errors, lay = checked_layout(c, world, use_te, tokenizer.vocab_size)
                    if errors:
                        continue
                    if lay.padded_vocab is None:
                        raise PlanError(f"cannot size the vocabulary ({tokenizer.error}); set model.vocab_size")
                    rm = most_loaded(c, lay, lay.padded_vocab, fused_adam, gpu)
                    if rm.total / GIB > fit_limit_gib(GPU_MEMORY_GIB[gpu]):
                        continue
                    cost = cost_model(c, lay, lay.padded_vocab, gpu, gpus_per_node, rm.params,
                                      rm.expert_params)
                    results.append({
                        "tensor": tp, "pipeline": pp, "virtual_pipeline": vp, "context": cp,
                        "cp_comm_type": comm if cp > 1 else None,
                        "data": lay.dp, "expert": ep, "fsdp": fsdp, "micro_batch_size": mbs,
                        "sequence_parallel": tp > 1, "placement": " ".join(place.overrides()) or None,
                        "recompute": gran, "memory_gib": round(rm.total / GIB, 2),
                        "bubble_fraction": cost.bubble_fraction, "step_s": cost.step_s,
                        "tokens_per_s_per_gpu": lay.gbs * m.seq_length / (cost.step_s * world),
                        "cost": {**asdict(cost)},
                        "overrides": _overrides(c),
                    })
    results.sort(key=lambda r: (r["step_s"], r["memory_gib"]))
    return results[:top] if top else results


def _overrides(c: Config) -> str:
    p = c.parallel
    parts = [f"parallel.tensor={p.tensor}", f"parallel.pipeline={p.pipeline}",
             f"parallel.virtual_pipeline={p.virtual_pipeline if p.virtual_pipeline else 'null'}",
             f"parallel.context={p.context}", f"parallel.sequence_parallel={str(p.sequence_parallel).lower()}",
             *([f"parallel.cp_comm_type={p.cp_comm_type}"] if p.context > 1 else []),
             f"parallel.tp_comm_overlap={str(p.tp_comm_overlap).lower()}",
             f"train.micro_batch_size={c.train.micro_batch_size}",
             "optimizer.fsdp=true" if c.optimizer.fsdp else "optimizer.distributed=true"]
    parts += Placement(p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage, p.pipeline_layout,
                       p.account_for_embedding_in_pipeline_split).overrides()
    if c.model.num_moe_experts:
        parts += [f"parallel.expert={p.expert}", "parallel.expert_tensor=1"]
    if c.model.recompute_granularity:
        parts.append(f"model.recompute_granularity={c.model.recompute_granularity}")
    if c.model.recompute_granularity == "full":
        parts += [f"model.recompute_method={c.model.recompute_method}",
                  f"model.recompute_num_layers={c.model.recompute_num_layers}"]
    return " ".join(parts)
