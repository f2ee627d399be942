"""Step-time cost model (ranks layouts for `--search`): the terms of `pretrain.planner.timing` assembled."""

from __future__ import annotations

from dataclasses import dataclass

from model_providers.core.model_plan import model_plan
from pretrain.config import Config
from pretrain.layout import Layout
from pretrain.planner.activations import recomputed_modules
from pretrain.planner.comm import bandwidth, dp_exposed, ep_all_to_all, ep_exposed
from pretrain.planner.constants import HBM_TBPS, value
from pretrain.planner.context import cp_comm_bytes
from pretrain.planner.hardware import nvlink_domain
from pretrain.planner.timing import rank_work, recompute_factor

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
    offload_s: float = 0.0  # activation offloading's host transfers beyond the compute they overlap
    kernel_s: float = 0.0  # of compute_s: the GPU's fixed time per kernel (`kernel_gpu_us`)

    @property
    def step_s(self) -> float:
        per_microbatch = self.compute_s + self.tp_comm_s + self.cp_comm_s + self.ep_exposed_s + self.offload_s
        return per_microbatch * (1 + self.bubble_fraction) + self.pp_comm_s + self.dp_comm_s + self.optimizer_s


def cost_model(cfg: Config, lay: Layout, padded_vocab: int, gpu: str, gpus_per_node: int,
               params_on_rank: int, expert_params_on_rank: int = 0) -> Cost:
    """Step time of `cfg` on `lay` (`pretrain.planner.timing`, `pretrain.planner.comm`; constants:
    `pretrain.planner.constants`). A group's traffic runs on NVLink inside one NVLink domain, else on the network."""
    m = cfg.model
    p = lay.bytes_per_value
    mb = lay.num_microbatches
    domain = nvlink_domain(gpu, gpus_per_node)
    works = [rank_work(m, cfg.performance, lay, padded_vocab, gpu, r) for r in range(lay.pp)]
    work = max(works, key=lambda w: w.busy_s)
    again = recompute_factor(cfg.model, work)
    modules = recomputed_modules(cfg.model)
    compute = mb * work.busy_s * again
    s, b, h = m.seq_length // lay.cp, lay.mbs, m.hidden_size
    recompute_fwd = 1.5 if m.recompute_granularity == "full" else 1.0
    # TP: with SP an all-gather + reduce-scatter per residual block, forward and backward (4 per block, 8 per layer).
    tp = mb * work.blocks * 4 * recompute_fwd * (lay.tp - 1) / lay.tp * s * b * h * p / bandwidth(gpu, lay.tp, domain)
    if cfg.parallel.tp_comm_overlap:
        tp *= value("tp_overlap_exposed")
    cp = mb * work.layers * cp_comm_bytes(model_plan(cfg), lay) / bandwidth(gpu, lay.tp * lay.cp, domain)
    if lay.cp > 1 and cfg.parallel.cp_comm_type == "p2p":  # the ring overlaps each step with attention
        cp = max(0.0, cp - mb * work.attention_s * again)
    hs = s * b * h // (lay.tp if lay.sp else 1)
    pp = 0.0
    if lay.pp > 1:  # a hop jumps world / PP ranks: inside one domain only when the whole world is
        pp = mb * lay.vp * 2 * hs * p / bandwidth(gpu, lay.world, domain)
        if lay.vp > 1:
            pp *= value("p2p_exposed")
    dp = dp_exposed(cfg, lay, params_on_rank, expert_params_on_rank, domain, gpu, work.busy_s * again)
    ep_s, ep_bytes_mb = ep_all_to_all(m, cfg.performance, lay, gpu, domain, work.moe_layers)
    moe_again = 1.5 if "moe" in modules else recompute_fwd
    ep_total = mb * ep_s * moe_again
    ep_hidden_behind = ep_exposed(cfg.performance, lay, gpu, ep_total, compute)
    bubble = (lay.pp - 1) / (lay.vp * mb) if lay.pp > 1 else 0.0
    owned = _owned_elements(lay, params_on_rank, expert_params_on_rank)
    optimizer = owned * value("optimizer_bytes_per_element") / (HBM_TBPS[gpu].value * 1e12)
    return Cost(compute, bubble, tp, cp, pp, dp, ep_total, int(ep_bytes_mb * mb * moe_again), ep_hidden_behind,
                optimizer, mb * work.gemm_s * again, mb * work.attention_s * again,
                mb * work.elementwise_s * again, mb * work.host_s * again,
                mb * _offload_exposed(cfg, lay, gpu, work.busy_s * again, work.layers), mb * work.kernel_s * again)


def _offload_exposed(cfg: Config, lay: Layout, gpu: str, microbatch_s: float, layers: int) -> float:
    """Per microbatch, what layer-wise activation offloading's copies to and from host memory leave exposed: the
    offloaded layers' activations cross the host link once each way, the copy out beside those layers' forward (1/3
    of their time), the copy back beside their backward (2/3)."""
    n = cfg.performance.cpu_offloading_num_layers
    if not n or lay.pp > 1 or cfg.model.recompute_granularity is not None:
        return 0.0
    from pretrain.planner.activations import stage_layers
    from pretrain.planner.hardware import GPUS

    moved = sum(stage_layers(cfg, lay, 0, 0)[:n]) / (GPUS[gpu].host_link_gbps * 1e9)
    window = microbatch_s * n / max(layers, 1)
    return max(0.0, moved - window / 3) + max(0.0, moved - 2 * window / 3)


def _owned_elements(lay: Layout, params: int, expert: int) -> float:
    """Elements whose optimizer state this rank holds."""
    if lay.distributed or lay.fsdp_sharding:
        return (params - expert) / (lay.dp * lay.cp) + expert / lay.edp
    return float(params)
