"""Step-time cost model (ranks layouts for `--search`)."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config import Config
from pretrain.flops import PEAK_TFLOPS, flops_per_token
from pretrain.layout import Layout
from pretrain.planner.activations import recomputed_modules
from pretrain.planner.common import GEMM_EFFICIENCY, NETWORK_GBPS, NVLINK_GBPS
from pretrain.planner.context import cp_comm_bytes
from pretrain.planner.stages import busiest_layers, compute_imbalance

FORMULA = ("F/token = 12·L·h²·[(1 + g/a + s/(2h))·(a·d/h) + (f/h)·(3/2 if gated else 1) + V/(2·L·h)] "
           "(Megatron's accounting: fwd+bwd = 3 GEMMs, causal attention halved; recompute not counted)")
MLA_FORMULA = ("MLA: the attention term is its projections P/(2h²) plus causal scores s·a·(d_qk + d_pe + d_v)/(4h²); "
               "MTP: + per MTP layer a transformer layer, its 2h → h projection and another output GEMM "
               "(pretrain/flops.py)")
MOE_FORMULA = ("MoE: the MLP term is k·(f_e/h)·(3/2 if gated else 1) + E/(2h) (top-k experts of f_e, router): "
               "FLOPs of the active parameters")


@dataclass
class Cost:
    """Transparent step-time model (seconds per step)."""

    compute_s: float
    bubble_fraction: float
    tp_comm_s: float
    cp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    ep_comm_s: float = 0.0  # MoE token all-to-all (and expert-TP gathers)
    ep_bytes_per_step: int = 0  # what one rank sends in those, per step

    @property
    def step_s(self) -> float:
        return (self.compute_s * (1 + self.bubble_fraction) + self.tp_comm_s + self.cp_comm_s
                + self.pp_comm_s + self.dp_comm_s + self.ep_comm_s)


def cost_model(cfg: Config, lay: Layout, padded_vocab: int, gpu: str, gpus_per_node: int,
               params_on_rank: int, expert_params_on_rank: int = 0) -> Cost:
    """Step time = compute/(GEMM efficiency) × (1 + bubble) + TP + CP + PP + DP communication (no overlap).

    - compute: model FLOPs per step / (world × peak × GEMM_EFFICIENCY), ×4/3 with full recompute and
      + the forward of what selective recompute recomputes (core attention; MoE layers with `moe`);
    - bubble: (P − 1) / (V · M) of the compute;
    - TP: 8 ring collectives per layer per microbatch (4 forward, 4 backward) of (t−1)/t · s·b·h·p bytes,
      over NVLink (TP stays inside a node);
    - CP: per layer and microbatch, `pretrain.planner.context.cp_comm_bytes` (p2p ring / all-gather of K and V,
      (cp−1)·2·(s/cp)·b·g·d/t·p, ×3 with the backward; a2a of Q, K, V and the output), NVLink when TP × CP fits
      in a node;
    - PP: each microbatch sends activations forward and gradients back once per model chunk;
    - DP: distributed optimizer reduce-scatter (fp32 grads) + all-gather (params), (n−1)/n of the rank's
      parameters each; without it an fp32 all-reduce (2·(n−1)/n). NVLink when the group fits in a node,
      else the network. MoE expert weights over expert data parallel (n = EDP) instead. Megatron-FSDP
      gathers and reduces per microbatch (`pretrain.planner.fsdp.fsdp_comm_bytes`);
    - EP (MoE): per layer and microbatch 4 all-to-alls (dispatch and combine, forward and backward), each
      sending the (EP−1)/EP of this rank's T·k routed token copies that go to other ranks (balanced routing),
      T·k·h·p bytes in all; with expert TP > 1 also 4 gathers/scatters of (ETP−1)·T·k·h·p. NVLink when the
      expert-TP × EP group (consecutive ranks) fits in a node, else the network. Full recompute or selective
      `moe` recompute runs the forward's two again (×1.5), and `moe` the MoE layers' forward FLOPs.
    """
    m = cfg.model
    p = lay.bytes_per_value
    fp8 = bool(m.fp8)
    peak = PEAK_TFLOPS[gpu]["fp8" if fp8 else "bf16"] * 1e12
    f_tok = flops_per_token(m, padded_vocab)
    compute = f_tok * lay.gbs * m.seq_length / (lay.world * peak * GEMM_EFFICIENCY)
    compute *= compute_imbalance(cfg, lay, padded_vocab)  # a pipeline runs at its busiest stage's pace
    h, a = m.hidden_size, m.num_attention_heads
    modules = recomputed_modules(cfg)
    d = lay.head_dim
    if m.recompute_granularity == "full":
        compute *= 4 / 3
    elif m.recompute_granularity == "selective":
        again = 0.0  # forward FLOPs per token run again in backward
        if "core_attn" in modules:
            again += 12 * m.num_layers * h * h * (m.seq_length / (2 * h)) * (a * d / h) / 3
        if m.num_moe_experts and "moe" in modules:  # the MoE layers: router and the top-k experts
            gemms = (3 if m.gated_linear_unit else 2) * h * lay.moe_ffn_hidden_size
            again += 2 * m.num_layers * (m.moe_router_topk * gemms + m.num_moe_experts * h)
        compute *= 1 + again / f_tok
    nv, net = NVLINK_GBPS[gpu] * 1e9, NETWORK_GBPS[gpu] * 1e9
    s, b = m.seq_length // lay.cp, lay.mbs
    mb, layers = lay.num_microbatches, busiest_layers(cfg, lay)
    recompute_fwd = 1.5 if m.recompute_granularity == "full" else 1.0
    moe_recompute = "moe" in modules
    tp = mb * layers * 8 * recompute_fwd * (lay.tp - 1) / lay.tp * s * b * h * p / nv
    cp_bw = nv if lay.tp * lay.cp <= gpus_per_node else net
    cp = mb * layers * cp_comm_bytes(cfg, lay) / cp_bw
    hs = s * b * h // (lay.tp if lay.sp else 1)
    pp = 0.0
    if lay.pp > 1:
        pp_bw = net if lay.world > gpus_per_node else nv
        pp = mb * lay.vp * 2 * hs * p / pp_bw
    dp_bw = nv if lay.tp * lay.cp * lay.dp <= gpus_per_node else net

    def reduce(params: int, n: int) -> float:
        if lay.distributed:
            return (n - 1) / n * params * (4 + p) / dp_bw
        return 2 * (n - 1) / n * params * 4 / dp_bw

    dp = reduce(params_on_rank - expert_params_on_rank, lay.dp * lay.cp) + reduce(expert_params_on_rank, lay.edp)
    if lay.fsdp_sharding:  # Megatron-FSDP: per-microbatch all-gathers / reduce-scatters (`planner/fsdp.py`)
        from pretrain.planner.fsdp import fsdp_comm_bytes

        dp = sum(fsdp_comm_bytes(cfg, lay, params_on_rank, expert_params_on_rank)) / dp_bw
    ep = 0.0
    ep_bytes = 0
    if m.num_moe_experts:
        copies = s * b // (lay.tp if lay.sp else 1) * m.moe_router_topk
        per_layer = 4 * copies * h * p * ((lay.ep - 1) / lay.ep + (lay.etp - 1))
        ep_bytes = int(mb * layers * (1.5 if moe_recompute else recompute_fwd) * per_layer)
        ep = ep_bytes / (nv if lay.etp * lay.ep <= gpus_per_node else net)
    bubble = (lay.pp - 1) / (lay.vp * mb) if lay.pp > 1 else 0.0
    return Cost(compute, bubble, tp, cp, pp, dp, ep, ep_bytes)
