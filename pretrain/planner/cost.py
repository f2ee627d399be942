"""Step-time cost model (ranks layouts for `--search`): the terms of `pretrain.planner.timing` assembled."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config import Config, OptimizerConfig
from pretrain.layout import Layout
from pretrain.planner.activations import recomputed_modules
from pretrain.planner.common import NETWORK_GBPS, NVLINK_GBPS
from pretrain.planner.constants import HBM_TBPS, value
from pretrain.planner.context import cp_comm_bytes
from pretrain.planner.timing import ep_seconds, rank_work, recompute_factor

FORMULA = ("F/token = 12·L·h²·[(1 + g/a + s/(2h))·(a·d/h) + (f/h)·(3/2 if gated else 1) + V/(2·L·h)] "
           "(Megatron's accounting: fwd+bwd = 3 GEMMs, causal attention halved; recompute not counted)")
MLA_FORMULA = ("MLA: the attention term is its projections P/(2h²) plus causal scores s·a·(d_qk + d_pe + d_v)/(4h²); "
               "MTP: + per MTP layer a transformer layer, its 2h → h projection and another output GEMM "
               "(pretrain/observe/flops.py)")
MOE_FORMULA = ("MoE: the MLP term is k·(f_e/h)·(3/2 if gated else 1) + E/(2h) (top-k experts of f_e, router): "
               "FLOPs of the active parameters")


@dataclass
class Cost:
    """Step-time model (seconds per step), by term; `pretrain.planner.timing` for what each counts."""

    compute_s: float  # the busiest pipeline rank's microbatches (GPU or host bound), recompute included
    bubble_fraction: float
    tp_comm_s: float  # exposed
    cp_comm_s: float  # exposed
    pp_comm_s: float
    dp_comm_s: float  # exposed (after overlap with the last backward / first forward)
    ep_comm_s: float = 0.0  # MoE token all-to-all: the transfer time (exposed: ep_exposed_s)
    ep_bytes_per_step: int = 0  # what one rank sends in those, per step
    ep_exposed_s: float = 0.0
    optimizer_s: float = 0.0
    gemm_s: float = 0.0  # of compute_s: GEMMs, attention, memory-bound kernels; host-bound when host_s is larger
    attention_s: float = 0.0
    elementwise_s: float = 0.0
    host_s: float = 0.0

    @property
    def step_s(self) -> float:
        per_microbatch = self.compute_s + self.tp_comm_s + self.cp_comm_s + self.ep_exposed_s
        return per_microbatch * (1 + self.bubble_fraction) + self.pp_comm_s + self.dp_comm_s + self.optimizer_s


def cost_model(cfg: Config, lay: Layout, padded_vocab: int, gpu: str, gpus_per_node: int,
               params_on_rank: int, expert_params_on_rank: int = 0) -> Cost:
    """Step time of `cfg` on `lay` (`pretrain.planner.timing`; constants: `pretrain.planner.constants`)."""
    m = cfg.model
    p = lay.bytes_per_value
    mb = lay.num_microbatches
    works = [rank_work(cfg, lay, padded_vocab, gpu, r) for r in range(lay.pp)]
    work = max(works, key=lambda w: w.busy_s)
    again = recompute_factor(cfg.model)
    modules = recomputed_modules(cfg.model)
    compute = mb * work.busy_s * again
    nv = NVLINK_GBPS[gpu] * 1e9 * value("nvlink_collective_efficiency")
    net = NETWORK_GBPS[gpu] * 1e9 * value("network_efficiency")
    s, b, h = m.seq_length // lay.cp, lay.mbs, m.hidden_size
    recompute_fwd = 1.5 if m.recompute_granularity == "full" else 1.0
    # TP: with SP an all-gather + reduce-scatter per GEMM pair, 4 each way per layer, over NVLink.
    tp = mb * work.layers * 8 * recompute_fwd * (lay.tp - 1) / lay.tp * s * b * h * p / nv
    if cfg.parallel.tp_comm_overlap:
        tp *= value("tp_overlap_exposed")
    cp_bw = nv if lay.tp * lay.cp <= gpus_per_node else net
    cp = mb * work.layers * cp_comm_bytes(cfg, lay) / cp_bw
    if lay.cp > 1 and cfg.parallel.cp_comm_type == "p2p":  # the ring overlaps each step with attention
        cp = max(0.0, cp - mb * work.attention_s * again)
    hs = s * b * h // (lay.tp if lay.sp else 1)
    pp = 0.0
    if lay.pp > 1:
        pp = mb * lay.vp * 2 * hs * p / (net if lay.world > gpus_per_node else nv)
        if lay.vp > 1:
            pp *= value("p2p_exposed")
    dp = _dp_exposed(cfg.optimizer, lay, params_on_rank, expert_params_on_rank, gpus_per_node, gpu, work.busy_s * again)
    ep_s, ep_bytes_mb = ep_seconds(cfg, lay, gpu, gpus_per_node, work.moe_layers)
    moe_again = 1.5 if "moe" in modules else recompute_fwd
    ep_total = mb * ep_s * moe_again
    ep_exposed = ep_total
    if cfg.performance.overlap_moe_expert_parallel_comm:  # a2a hidden behind another microbatch
        ep_exposed = max(0.0, ep_total - compute)
    bubble = (lay.pp - 1) / (lay.vp * mb) if lay.pp > 1 else 0.0
    owned = _owned_elements(lay, params_on_rank, expert_params_on_rank)
    optimizer = owned * value("optimizer_bytes_per_element") / (HBM_TBPS[gpu].value * 1e12)
    return Cost(compute, bubble, tp, cp, pp, dp, ep_total, int(ep_bytes_mb * mb * moe_again), ep_exposed,
                optimizer, mb * work.gemm_s * again, mb * work.attention_s * again,
                mb * work.elementwise_s * again, mb * work.host_s * again)


def _owned_elements(lay: Layout, params: int, expert: int) -> float:
    """Elements whose optimizer state this rank holds."""
    if lay.distributed or lay.fsdp_sharding:
        return (params - expert) / (lay.dp * lay.cp) + expert / lay.edp
    return float(params)


def _dp_exposed(o: OptimizerConfig, lay: Layout, params: int, expert: int, gpus_per_node: int, gpu: str,
                microbatch_s: float) -> float:
    """Data-parallel gradient reduce-scatter and parameter all-gather (or all-reduce), what overlap leaves.

    The distributed optimizer reduce-scatters fp32 (grad_reduce_in_fp32) or bf16 gradients and all-gathers
    parameters, (n−1)/n of the rank's parameters each, over NVLink when the group is inside a node, else the
    network; expert weights over expert data parallel. With overlap_grad_reduce the reduce-scatter runs during the
    last microbatch's backward (2/3 of it), with overlap_param_gather the all-gather during the first forward (1/3).
    Megatron-FSDP gathers and reduces every microbatch (`planner.fsdp`), overlapped with that microbatch. `o`: the
    optimizer section."""
    p = lay.bytes_per_value
    g = 4 if o.grad_reduce_in_fp32 else p
    inside = lay.tp * lay.cp * lay.dp <= gpus_per_node
    bw = NVLINK_GBPS[gpu] * 1e9 * value("nvlink_collective_efficiency") if inside else \
        NETWORK_GBPS[gpu] * 1e9 * value("network_efficiency")
    if lay.fsdp_sharding:
        from pretrain.planner.fsdp import fsdp_comm_bytes

        per_microbatch = sum(fsdp_comm_bytes(o, lay, params, expert)) / bw / lay.num_microbatches
        return lay.num_microbatches * max(0.0, per_microbatch - microbatch_s)

    def share(n: int) -> float:
        return (n - 1) / n if n > 1 else 0.0

    dense, experts = params - expert, expert
    if lay.distributed:
        rs = (share(lay.dp * lay.cp) * dense + share(lay.edp) * experts) * g / bw
        ag = (share(lay.dp * lay.cp) * dense + share(lay.edp) * experts) * p / bw
    else:
        rs = 2 * (share(lay.dp * lay.cp) * dense + share(lay.edp) * experts) * g / bw
        ag = 0.0
    if o.overlap_grad_reduce:
        rs = max(0.0, rs - 2 / 3 * microbatch_s)
    if o.overlap_param_gather:
        ag = max(0.0, ag - 1 / 3 * microbatch_s)
    return rs + ag
