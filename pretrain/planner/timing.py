"""The calibrated step-time model: measurable terms per pipeline rank, constants in `planner.constants`.

Per microbatch, the busiest pipeline rank spends (each term from this rank's own parameters, `census`):

- GEMMs: every linear weight of its chunks (forward, data-gradient, weight-gradient), each a roofline
  max(FLOPs / (peak × efficiency(precision)), bytes / HBM), MoE experts as grouped GEMMs at their real token count
  (T·k·EP / E per local expert, balanced routing), plus TE's FP8 casts (memory-bound) under FP8 recipes;
- attention: causal flash attention in bf16 at `attention_efficiency` (MLA: its qk and v widths);
- memory-bound work: norms, residuals, RoPE, SwiGLU (`elementwise_passes` h-wide passes per token), MoE permutes;
- the host: when kernels are small the CPU's launches bound the layer (max of GPU time and kernels × launch time;
  CUDA graphs shrink the launch time);
- TP all-gather/reduce-scatter (exposed `tp_overlap_exposed` with tp_comm_overlap), CP (`planner.context`),
  EP all-to-all: the copies leaving the node over the network (one per destination node with DeepEP / HybridEP,
  which deduplicate), the rest over NVLink, blocking unless overlap_moe_expert_parallel_comm.

The step: (M + (P − 1)/V) × the busiest rank's microbatch time (the 1F1B bubble with interleaving), plus what the
data-parallel reduce-scatter / all-gather leaves exposed after the last backward / first forward
(overlap_grad_reduce / overlap_param_gather), Megatron-FSDP's per-microbatch traffic beyond its compute, and the
optimizer step (memory-bound over the elements this rank owns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from model_providers.core.windows import mean_attended_keys
from pretrain.config import Config, ModelConfig
from pretrain.layout import Layout
from pretrain.observe.flops import PEAK_TFLOPS
from pretrain.planner.activations import recomputed_modules
from pretrain.planner.census import Param, chunk_parameters, is_moe_layer
from pretrain.planner.common import NETWORK_GBPS, NVLINK_GBPS
from pretrain.planner.constants import ATTENTION_EFFICIENCY, HBM_TBPS, value
from pretrain.planner.mla import recompute_shares


@dataclass
class RankWork:
    """Seconds of one pipeline rank's microbatch, by term."""

    gemm_s: float = 0.0
    attention_s: float = 0.0
    elementwise_s: float = 0.0
    host_s: float = 0.0  # what the kernel launches cost the host
    layers: int = 0
    moe_layers: int = 0

    @property
    def gpu_s(self) -> float:
        return self.gemm_s + self.attention_s + self.elementwise_s

    @property
    def busy_s(self) -> float:
        return max(self.gpu_s, self.host_s)


def _gemm_s(m_rows: float, numel: int, gpu: str, fp8: str | None, grouped: bool = False,
            narrow_dim: float | None = None) -> float:
    """Forward + both backward GEMMs of a weight of `numel` elements over `m_rows` rows (roofline);
    the efficiency falls with the GEMM's narrowest dimension d as d / (d + gemm_half_efficiency_dim)."""
    if m_rows <= 0 or numel <= 0:
        return 0.0
    key = "bf16" if not fp8 else ("mxfp8" if fp8 == "mxfp8" else "fp8")
    eff = value(f"gemm_efficiency_{key}") * (value("grouped_gemm_efficiency") if grouped else 1.0)
    peak = PEAK_TFLOPS[gpu]["fp8" if fp8 else "bf16"] * 1e12
    hbm = HBM_TBPS[gpu].value * 1e12
    width = 2 * math.sqrt(numel)  # K + N of a K×N weight, taken square
    narrow = min(m_rows, narrow_dim or width / 2)
    eff *= narrow / (narrow + value("gemm_half_efficiency_dim"))
    elem = 1 if fp8 else 2
    flops = 2 * m_rows * numel
    moved = (m_rows * width + numel) * elem
    per = max(flops / (peak * eff), moved / hbm)
    # FP8: the input (M·K), the output gradient (M·N) and the weight cast once each per microbatch
    cast = value("fp8_cast_bytes_per_element") * (m_rows * width + numel) / hbm if fp8 else 0.0
    return 3 * per + cast


def rank_work(cfg: Config, lay: Layout, vocab: int, gpu: str, pp_rank: int) -> RankWork:
    """One microbatch of pipeline rank `pp_rank` (all its model chunks)."""
    m = cfg.model
    fp8 = m.fp8 if (m.fp8 and lay.use_te) else None
    if cfg.performance.fp4_recipe and lay.use_te:
        fp8 = "fp8"  # NVFP4 GEMMs counted at the FP8 rate (no FP4 peak in the table: conservative)
    tokens = m.seq_length * lay.mbs / lay.cp  # rows of every TP-sharded GEMM (SP gathers them first)
    hbm = HBM_TBPS[gpu].value * 1e12
    h, a = m.hidden_size, m.num_attention_heads
    w = RankWork()
    params: list[Param] = []
    for v in range(lay.vp):
        params += chunk_parameters(cfg.model, lay, vocab, pp_rank, v)
        offset, n = lay.chunk_layers(m.num_layers, pp_rank, v)
        w.layers += n
        w.moe_layers += sum(is_moe_layer(m, offset + i) for i in range(n))
    if pp_rank == lay.pp - 1 and m.mtp_num_layers:
        w.layers += m.mtp_num_layers
        w.moe_layers += m.mtp_num_layers * is_moe_layer(m, m.num_layers - 1)
    # Rows of each local expert (balanced routing): the EP group's T·k copies over E experts, ×ETP (expert TP gathers
    # its group's tokens).
    expert_rows = tokens * (m.moe_router_topk or 0) * lay.ep * lay.etp / (m.num_moe_experts or 1)
    if lay.sp and lay.etp == 1:
        expert_rows /= lay.tp  # each TP rank routes its sequence-parallel slice
    for p in params:
        narrow = min(h, p.numel / h)  # one side of every decoder GEMM is the hidden size (MLA's LoRA: close)
        if p.expert and p.name.endswith(".weight"):
            w.gemm_s += _gemm_s(expert_rows, p.numel, gpu, fp8, grouped=True, narrow_dim=narrow)
        elif p.linear:
            w.gemm_s += _gemm_s(tokens, p.numel, gpu, fp8, narrow_dim=narrow)
        elif p.name == "output_layer.weight":
            w.gemm_s += _gemm_s(tokens, p.numel, gpu, None)  # the logits stay bf16
            w.elementwise_s += 3 * tokens * vocab / lay.tp * 4 / hbm  # fp32 softmax cross-entropy fwd+bwd
        elif p.name.endswith(".router.weight"):
            w.gemm_s += _gemm_s(tokens / (lay.tp if lay.sp else 1), p.numel, gpu, None)
    # Attention core (bf16), causal.
    if m.multi_latent_attention:
        qk, v_dim = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    else:
        qk = v_dim = lay.head_dim
    # QK^T and PV over the keys each query attends to (s/2 causal; less with a sliding window)
    fwd = 2 * tokens * mean_attended_keys(m) * (a / lay.tp) * (qk + v_dim)
    att = fwd * (1 + value("attention_backward_ratio"))
    w.attention_s = w.layers * att / (PEAK_TFLOPS[gpu]["bf16"] * 1e12 * ATTENTION_EFFICIENCY[gpu].value)
    # Memory-bound work: per token per layer, on this rank's (SP-sharded) activations.
    rows = tokens / (lay.tp if lay.sp else 1)
    p_bytes = lay.bytes_per_value
    w.elementwise_s += w.layers * value("elementwise_passes") * rows * h * p_bytes / hbm
    copies = rows * (m.moe_router_topk or 0)
    w.elementwise_s += w.moe_layers * value("moe_permute_passes") * copies * h * p_bytes / hbm
    launch = value("launch_us_cuda_graphs" if _cuda_graphs(cfg.performance) else "launch_us") * 1e-6
    dense_layers = w.layers - w.moe_layers
    kernels = dense_layers * value("kernels_per_dense_layer") + w.moe_layers * value("kernels_per_moe_layer")
    w.host_s = launch * kernels
    return w


def _cuda_graphs(perf) -> bool:
    """CUDA graphs are on (the performance section `perf`)."""
    return perf.cuda_graph_impl != "none"


def recompute_factor(m: ModelConfig) -> float:
    """Extra compute of recomputation, as a factor on a microbatch (full: the forward again, ~1/3)."""
    if m.recompute_granularity == "full":
        return 4 / 3
    modules = recomputed_modules(m)
    extra = recompute_shares(m, modules)  # mla_up_proj, shared_experts, a dense-first model's mlp: from FLOPs
    if "moe" in modules or ("mlp" in modules and not m.num_moe_experts):
        extra += value("recompute_mlp_extra")
    if "core_attn" in modules:
        extra += value("recompute_core_attn_extra")
    return 1 + extra


def ep_seconds(cfg: Config, lay: Layout, gpu: str, gpus_per_node: int, moe_layers: int) -> tuple[float, int]:
    """(seconds, bytes sent) of one microbatch's token all-to-alls on this rank: dispatch and combine, forward and
    backward; the copies for other nodes over the network (one per destination node with DeepEP / HybridEP), the
    rest over NVLink."""
    m = cfg.model
    if not m.num_moe_experts or lay.ep == 1 and lay.etp == 1:
        return 0.0, 0
    p = lay.bytes_per_value
    rows = m.seq_length * lay.mbs / lay.cp / (lay.tp if lay.sp else 1)
    k, h = m.moe_router_topk, m.hidden_size
    total = 4 * rows * k * h * p * ((lay.ep - 1) / lay.ep + (lay.etp - 1))  # every copy sent, as before
    nodes = max(1, lay.ep * lay.etp // gpus_per_node)
    off_node = 0.0
    if nodes > 1:
        share = (nodes - 1) / nodes  # of a token's copies, those to experts on other nodes
        copies = k * share
        if cfg.performance.moe_flex_dispatcher_backend:
            # one copy per destination node: the expected number of other nodes among the k experts
            copies = (nodes - 1) * (1 - (1 - 1 / nodes) ** k)
        off_node = 4 * rows * copies * h * p
    on_node = max(total - 4 * rows * k * share * h * p, 0.0) if nodes > 1 else total
    nv = NVLINK_GBPS[gpu] * 1e9 * value("nvlink_a2a_efficiency")
    net = NETWORK_GBPS[gpu] * 1e9 * value("network_efficiency")
    seconds = moe_layers * max(on_node / nv, off_node / net)
    return seconds, int(moe_layers * total)
