"""Communication in the step-time model: which link a group's traffic takes, the MoE all-to-all and what its overlap
leaves exposed, and the data-parallel gradient / parameter collectives.

A group of ranks talks over NVLink when its consecutive ranks stay inside one NVLink domain
(`planner.hardware.nvlink_domain`: the node of a DGX/HGX, the 72-GPU rack of an NVL72 whatever the node), else over
the scale-out network at the NIC's bandwidth per GPU. Megatron-Core orders ranks TP fastest, then CP, then DP (and EP
inside TP × CP × DP for experts), PP slowest: a TP group spans `tp` consecutive ranks, CP `tp·cp`, DP and expert DP
`tp·cp·dp`, EP `etp·ep`; a pipeline hop jumps `world / pp` ranks (inside one domain only when the world is).
"""

from __future__ import annotations

from pretrain.config import Config, ModelConfig, PerformanceConfig
from pretrain.layout import Layout
from pretrain.planner.census import routed_width
from pretrain.planner.constants import value
from pretrain.planner.hardware import GPUS, domains_spanned


def bandwidth(gpu: str, span: int, domain: int, nvlink_efficiency: str = "nvlink_collective_efficiency") -> float:
    """Bytes/s a group of `span` consecutive ranks reaches point to point: NVLink inside one domain, else the
    network (the sending GPU's own NIC)."""
    g = GPUS[gpu]
    if span <= domain:
        return g.nvlink_gbps * 1e9 * value(nvlink_efficiency)
    return g.network_gbps * 1e9 * value("network_efficiency")


def collective_bandwidth(gpu: str, span: int, members: int, domain: int) -> float:
    """Bus bandwidth of a ring all-gather / reduce-scatter over `members` ranks spread evenly over `span` consecutive
    ranks: NVLink inside one domain; across D domains the ring crosses each domain boundary once per channel and
    NCCL spreads its channels over the NICs of the domain's k = members / D ranks (every other group does the same
    on its own ranks' NICs), so the network carries it at k NICs' bandwidth, at most NVLink's."""
    nv = bandwidth(gpu, 1, domain)
    if span <= domain:
        return nv
    k = max(1, members // domains_spanned(span, domain))
    return min(nv, k * bandwidth(gpu, span, domain))


def ep_all_to_all(m: ModelConfig, perf: PerformanceConfig, lay: Layout, gpu: str, domain: int,
                  moe_layers: int) -> tuple[float, int]:
    """(seconds, bytes sent) of one microbatch's token all-to-alls on this rank: dispatch and combine, forward and
    backward. An EP group inside one NVLink domain runs on NVLink. One that spans D domains sends the copies for
    experts in other domains over the network, concurrently with the rest on NVLink: k·(D − 1)/D copies per token
    (NCCL's all-to-all), or one per destination domain with DeepEP / HybridEP, which deduplicate and forward them
    over the destination's NVLink (every copy then crosses NVLink once). `m`, `perf`: the model and performance
    sections."""
    if not m.num_moe_experts or lay.ep == 1 and lay.etp == 1:
        return 0.0, 0
    rows = m.seq_length * lay.mbs / lay.cp / (lay.tp if lay.sp else 1)
    k = m.moe_router_topk
    per_copy = 4 * rows * routed_width(m) * lay.bytes_per_value  # dispatch + combine, forward + backward
    total = per_copy * k * ((lay.ep - 1) / lay.ep + (lay.etp - 1))
    d = domains_spanned(lay.ep * lay.etp, domain)
    nv = bandwidth(gpu, 1, domain, "nvlink_a2a_efficiency")
    if d == 1:
        return moe_layers * total / nv, int(moe_layers * total)
    share = (d - 1) / d  # of a token's copies, those for experts in other domains
    if perf.moe_flex_dispatcher_backend:
        off, on = per_copy * (d - 1) * (1 - (1 - 1 / d) ** k), total
    else:
        off, on = per_copy * k * share, max(total - per_copy * k * share, 0.0)
    net = GPUS[gpu].network_gbps * 1e9 * value("network_efficiency")
    return moe_layers * max(on / nv, off / net), int(moe_layers * total)


def ep_unpaired_share(lay: Layout) -> float:
    """Of a step's all-to-all, the share Megatron-Core's 1F1B all-to-all overlap has no other microbatch to hide
    behind: without pipelining the first forward and the last backward (1/M); interleaved, the warm-up forwards and
    cool-down backwards of the first stage, 2·(P − 1) + (V − 1)·P + 1 of its M·V chunk steps."""
    steps = lay.num_microbatches * lay.vp
    if lay.pp == 1:
        return 1 / lay.num_microbatches
    return min(1.0, (2 * (lay.pp - 1) + (lay.vp - 1) * lay.pp + 1) / steps)


def ep_exposed(perf: PerformanceConfig, lay: Layout, gpu: str, ep_total: float, compute: float) -> float:
    """What a step's all-to-all (`ep_total` seconds) leaves on the critical path. Without
    `performance.overlap_moe_expert_parallel_comm` all of it. With it, Megatron-Core pairs one microbatch's forward
    with another's backward and runs each one's all-to-all beside the other's compute: the unpaired share
    (`ep_unpaired_share`) stays exposed, the paired all-to-all beyond the paired compute too, and while the two run
    together the communication kernels hold their SMs (DeepEP, HybridEP or NCCL: the constants), so that compute runs
    on the rest of the GPU: a slowdown of f / (1 − f) of the overlapped time, f = their SMs / the GPU's (`perf`: the
    performance section)."""
    if not perf.overlap_moe_expert_parallel_comm or ep_total <= 0:
        return ep_total
    unpaired = ep_unpaired_share(lay)
    comm, comp = ep_total * (1 - unpaired), compute * (1 - unpaired)
    backend = perf.moe_flex_dispatcher_backend
    sms = value(f"{backend}_sms" if backend else "nccl_a2a_sms")
    f = min(sms / GPUS[gpu].sms, 0.9)
    return ep_total * unpaired + max(0.0, comm - comp) + min(comm, comp) * f / (1 - f)


def dp_exposed(cfg: Config, lay: Layout, params: int, expert: int, domain: int, gpu: str,
               microbatch_s: float) -> float:
    """Data-parallel gradient reduce-scatter and parameter all-gather (or all-reduce), what overlap leaves.

    The distributed optimizer reduce-scatters fp32 (grad_reduce_in_fp32) or bf16 gradients and all-gathers
    parameters, (n−1)/n of the rank's parameters each — 1 byte per parameter with FP8 parameter all-gather
    (`model.fp8_param_gather` under an FP8 / MXFP8 recipe), else the parameter dtype — over NVLink when the group
    is inside one domain, else over the network at the bus bandwidth of the group's NICs (`collective_bandwidth`);
    expert weights over expert data parallel, at that group's own NICs. With overlap_grad_reduce the
    reduce-scatter runs during the last microbatch's backward (2/3 of it), with overlap_param_gather the all-gather
    during the first forward (1/3). Megatron-FSDP gathers and reduces every microbatch (`planner.fsdp`), overlapped
    with that microbatch."""
    o = cfg.optimizer
    p = lay.bytes_per_value
    g = 4 if o.grad_reduce_in_fp32 else p
    gathered = 1 if cfg.model.fp8_param_gather and cfg.model.fp8 and lay.use_te else p
    bw = collective_bandwidth(gpu, lay.tp * lay.cp * lay.dp, lay.cp * lay.dp, domain)
    if lay.fsdp_sharding:
        from pretrain.planner.fsdp import fsdp_comm_bytes

        per_microbatch = sum(fsdp_comm_bytes(o, lay, params, expert)) / bw / lay.num_microbatches
        return lay.num_microbatches * max(0.0, per_microbatch - microbatch_s)

    def share(n: int) -> float:
        return (n - 1) / n if n > 1 else 0.0

    # Expert weights reduce over expert data parallel: EDP ranks one EP group apart (ETP × EP consecutive ranks), so an
    # EP group that fills its NVLink domain leaves one EDP member per domain: the ring runs at one NIC per domain.
    expert_bw = collective_bandwidth(gpu, lay.tp * lay.cp * lay.dp, lay.edp, domain)
    seconds = share(lay.dp * lay.cp) * (params - expert) / bw + share(lay.edp) * expert / expert_bw
    if lay.distributed:
        rs, ag = seconds * g, seconds * gathered
    else:
        rs, ag = 2 * seconds * g, 0.0
    if o.overlap_grad_reduce:
        rs = max(0.0, rs - 2 / 3 * microbatch_s)
    if o.overlap_param_gather:
        ag = max(0.0, ag - 1 / 3 * microbatch_s)
    return rs + ag
