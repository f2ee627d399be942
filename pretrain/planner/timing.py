"""The calibrated step-time model: measurable terms per pipeline rank, constants in `planner.constants`.

Per microbatch, the busiest pipeline rank spends (each term from this rank's own parameters, `census`):

- GEMMs: every linear weight of its chunks (forward, data-gradient, weight-gradient), each a roofline
  max(FLOPs / (peak × efficiency(precision)), bytes / HBM), MoE experts as grouped GEMMs at their real token count
  (T·k·EP / E per local expert, balanced routing), plus TE's FP8 casts (memory-bound) under FP8 recipes;
- attention: causal flash attention in bf16 at `attention_efficiency` (MLA: its qk and v widths);
- memory-bound work: norms, residuals, RoPE, SwiGLU (`elementwise_passes` h-wide passes per token), MoE permutes;
- per kernel, a fixed GPU time beside its work (`kernel_gpu_us`: the gap to its neighbour, its ramp and last partial
  wave), CUDA graph or not;
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

import functools
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from model_providers.core import hybrid, quant_recipe
from model_providers.core.fusions import bias_activation_fusion
from model_providers.core.windows import window_size, windowed_layers
from pretrain.config import ModelConfig, PerformanceConfig
from pretrain.layout import Layout
from pretrain.observe.flops import PEAK_TFLOPS
from pretrain.planner import mamba
from pretrain.planner.activations import recomputed_modules
from pretrain.planner.census import Param, chunk_parameters, is_moe_layer, routed_width
from pretrain.planner.common import PlanError
from pretrain.planner.constants import ATTENTION_EFFICIENCY, HBM_TBPS, SUSTAINED, value
from pretrain.planner.mla import recompute_shares
from pretrain.planner.precision import fp8_transposes

# Bytes per GEMM input element, and the casts Transformer Engine adds around a low-precision GEMM (constants).
_ELEMENT_BYTES = {"bf16": 2.0, "fp8": 1.0, "mxfp8": 1.0, "nvfp4": 0.5}
_DECODER_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_CAST = {"fp8": "fp8_cast_bytes_per_element", "mxfp8": "fp8_cast_bytes_per_element",
         "nvfp4": "fp4_cast_bytes_per_element"}


@dataclass
class RankWork:
    """Seconds of one pipeline rank's microbatch, by term."""

    gemm_s: float = 0.0
    attention_s: float = 0.0
    elementwise_s: float = 0.0
    host_s: float = 0.0  # what the kernel launches cost the host
    kernel_s: float = 0.0  # the GPU's fixed time per kernel beside its work (`kernel_gpu_us`)
    norm_s: float = 0.0  # of elementwise_s: the norms' forward (what `layernorm` recompute runs again)
    moe_act_s: float = 0.0  # the experts' activation forward (what `moe_act` recompute runs again)
    layers: int = 0
    moe_layers: int = 0
    blocks: int = 0  # residual blocks (a transformer layer: 2; a hybrid model's layer: 1): TP collectives per block

    @property
    def gpu_s(self) -> float:
        return self.gemm_s + self.attention_s + self.elementwise_s + self.kernel_s

    @property
    def busy_s(self) -> float:
        return max(self.gpu_s, self.host_s)


def _gemm_s(m_rows: float, numel: int, gpu: str, precision: str, grouped: bool = False,
            narrow_dim: float | None = None, transposes: bool = True) -> float:
    """Forward + both backward GEMMs of a weight of `numel` elements over `m_rows` rows (roofline) at `precision`
    (bf16, fp8, mxfp8, nvfp4: its peak and efficiency); the efficiency falls with the GEMM's narrowest dimension d as
    d / (d + gemm_half_efficiency_dim). `transposes`: TE's FP8 casts write a column-wise copy too (not for
    per-tensor-scaled FP8 on Blackwell, `planner.precision.fp8_transposes`: one byte per element less)."""
    if m_rows <= 0 or numel <= 0:
        return 0.0
    eff = value(f"gemm_efficiency_{precision}") * (value("grouped_gemm_efficiency") if grouped else 1.0)
    peak = PEAK_TFLOPS[gpu][precision] * 1e12 * SUSTAINED[gpu].value
    hbm = HBM_TBPS[gpu].value * 1e12
    width = 2 * math.sqrt(numel)  # K + N of a K×N weight, taken square
    narrow = min(m_rows, narrow_dim or width / 2)
    eff *= narrow / (narrow + value("gemm_half_efficiency_dim"))
    elem = _ELEMENT_BYTES[precision]
    flops = 2 * m_rows * numel
    moved = (m_rows * width + numel) * elem
    per = max(flops / (peak * eff), moved / hbm)
    # low precision: the input (M·K), the output gradient (M·N) and the weight cast once each per microbatch
    cast_bytes = value(_CAST[precision]) - (0 if transposes or precision != "fp8" else 1) if precision in _CAST else 0.0
    cast = cast_bytes * (m_rows * width + numel) / hbm
    return 3 * per + cast


def run_precision(m: ModelConfig, perf: PerformanceConfig, lay: Layout, gpu: str) -> str:
    """The GEMM precision of the run on `gpu` (`quant_recipe.precision_of` of model.fp8 and performance.fp4_recipe;
    FP8 and FP4 need Transformer Engine); PlanError when the GPU has no tensor cores for it (MXFP8 and NVFP4 are
    Blackwell's)."""
    precision = quant_recipe.precision_of(m.fp8, perf.fp4_recipe) if lay.use_te else "bf16"
    if precision not in PEAK_TFLOPS[gpu]:
        raise PlanError(f"{gpu} has no {precision.upper()} tensor cores (known on: "
                        f"{', '.join(g for g, p in PEAK_TFLOPS.items() if precision in p)})")
    return precision


@functools.lru_cache(maxsize=8)
def _recipe_rules(path: str) -> tuple[quant_recipe.Rule, ...]:
    """The recipe file's rules, read once per planning process (rank_work runs per pipeline rank and placement)."""
    return tuple(quant_recipe.read(path))


def gemm_precisions(m: ModelConfig, perf: PerformanceConfig, run: str, gpu: str) -> Callable[[str, int], str]:
    """(parameter name, its chunk's first global layer) -> its GEMM's precision: the run's, but BF16 in the first /
    last `performance.num_layers_at_{start,end}_in_bf16` decoder layers, and as `performance.quant_recipe`'s
    matchers say (`model_providers.core.quant_recipe`, matched on the parameter's module path)."""
    start, end = perf.num_layers_at_start_in_bf16, perf.num_layers_at_end_in_bf16
    try:
        rules = _recipe_rules(perf.quant_recipe) if perf.quant_recipe else ()
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    if run == "bf16" or not (start or end or rules):
        return lambda name, offset: run
    for r in rules:
        if r.precision not in PEAK_TFLOPS[gpu]:
            raise PlanError(f"performance.quant_recipe matcher {r.name!r} asks for {r.precision.upper()} GEMMs; {gpu} "
                            "has no such tensor cores")

    def of(name: str, offset: int) -> str:
        hit = _DECODER_LAYER.match(name)
        layer = offset + int(hit.group(1)) if hit else None
        quantized = layer is None or start <= layer < m.num_layers - end
        return quant_recipe.gemm_precision(rules, name.rsplit(".", 1)[0], run, quantized)
    return of


def rank_work(m: ModelConfig, perf: PerformanceConfig, lay: Layout, vocab: int, gpu: str, pp_rank: int) -> RankWork:
    """One microbatch of pipeline rank `pp_rank` (all its model chunks; `m`, `perf`: the model and performance
    sections)."""
    precision = run_precision(m, perf, lay, gpu)
    transposes = fp8_transposes(m, gpu)
    tokens = m.seq_length * lay.mbs / lay.cp  # rows of every TP-sharded GEMM (SP gathers them first)
    hbm = HBM_TBPS[gpu].value * 1e12
    h, a = m.hidden_size, m.num_attention_heads
    w = RankWork()
    params: list[tuple[Param, int]] = []  # each with its chunk's first layer (global index)
    for v in range(lay.vp):
        offset, n = lay.chunk_layers(m.num_layers, pp_rank, v)
        params += [(p, offset) for p in chunk_parameters(m, lay, vocab, pp_rank, v)]
        w.layers += n
        w.moe_layers += sum(is_moe_layer(m, offset + i) for i in range(n))
    kinds = layer_kinds(m, lay, pp_rank)  # hybrid models: this rank's layers by pattern symbol
    if pp_rank == lay.pp - 1 and m.mtp_num_layers:  # a transformer's MTP depth is a layer; a hybrid's, its pattern
        w.layers += m.mtp_num_layers if kinds is None else sum(hybrid.mtp_counts(m).values())
        w.moe_layers += m.mtp_num_layers * is_moe_layer(m, m.num_layers - 1)
    if kinds is not None:
        w.moe_layers = kinds[hybrid.MOE]
    attention_layers = w.layers if kinds is None else kinds[hybrid.ATTENTION]
    w.blocks = 2 * w.layers if kinds is None else w.layers
    # Rows of each local expert (balanced routing): the EP group's T·k copies over E experts, ×ETP (expert TP gathers
    # its group's tokens).
    expert_rows = tokens * (m.moe_router_topk or 0) * lay.ep * lay.etp / (m.num_moe_experts or 1)
    if lay.sp and lay.etp == 1:
        expert_rows /= lay.tp  # each TP rank routes its sequence-parallel slice
    precision_of = gemm_precisions(m, perf, precision, gpu)
    for p, offset in params:
        narrow = min(h, p.numel / h)  # one side of every decoder GEMM is the hidden size (MLA's LoRA: close)
        if p.expert and p.name.endswith(".weight"):
            w.gemm_s += _gemm_s(expert_rows, p.numel, gpu, precision_of(p.name, offset), grouped=True,
                                narrow_dim=narrow, transposes=transposes)
        elif p.linear:
            w.gemm_s += _gemm_s(tokens, p.numel, gpu, precision_of(p.name, offset), narrow_dim=narrow,
                                transposes=transposes)
        elif p.name == "output_layer.weight":
            w.gemm_s += _gemm_s(tokens, p.numel, gpu, "bf16")  # the logits stay bf16
            w.elementwise_s += 3 * tokens * vocab / lay.tp * 4 / hbm  # fp32 softmax cross-entropy fwd+bwd
        elif p.name.endswith(".router.weight"):
            w.gemm_s += _gemm_s(tokens / (lay.tp if lay.sp else 1), p.numel, gpu, "bf16")
    # Attention core (bf16), causal: QK^T and PV over the keys each query's tiles compute (`computed_keys`)
    if m.multi_latent_attention:
        qk, v_dim = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    else:
        qk = v_dim = lay.head_dim
    fwd = 2 * tokens * computed_keys(m) * (a / lay.tp) * (qk + v_dim)
    att = fwd * (1 + value("attention_backward_ratio"))
    d_half = value("attention_half_efficiency_head_dim")
    head = (qk / (qk + d_half)) / (128 / (128 + d_half))  # 1 at head dim 128
    sinks = value("attention_sinks_efficiency") if m.softmax_type not in (None, "vanilla") else 1.0
    fused_rate = PEAK_TFLOPS[gpu]["bf16"] * 1e12 * SUSTAINED[gpu].value * ATTENTION_EFFICIENCY[gpu].value
    w.attention_s = attention_layers * att / (fused_rate * min(head, 1.25) * sinks)
    if kinds is not None:  # Mamba-2 layers: the SSD scan as fused attention over 2K tokens (mamba.py); the rest
        p_dim, ref = m.mamba_head_dim, mamba.SSD_ATTENTION_EQUIVALENT_TOKENS
        ssd = 2 * tokens * (ref / 2 + value("attention_tile") / 2) * (hybrid.mamba_num_heads(m) / lay.tp) * 2 * p_dim
        ssd_head = (p_dim / (p_dim + d_half)) / (128 / (128 + d_half))
        w.attention_s += kinds[hybrid.MAMBA] * ssd * (1 + value("attention_backward_ratio")) / (
            fused_rate * min(ssd_head, 1.25))
        w.elementwise_s += kinds[hybrid.MAMBA] * mamba.mixer_bytes(m, lay) / hbm
    # Memory-bound work: per token per layer, on this rank's (SP-sharded) activations.
    rows = tokens / (lay.tp if lay.sp else 1)
    p_bytes = lay.bytes_per_value
    # a transformer layer's two blocks; a hybrid layer is one block (half of them; a Mamba block: its norm and residual,
    # 2 RMSNorm + 2 residual of the 36 being ~14, so 7)
    passes = w.layers * value("elementwise_passes") if kinds is None else \
        (w.layers - kinds[hybrid.MAMBA]) * value("elementwise_passes") / 2 + kinds[hybrid.MAMBA] * 7
    w.elementwise_s += passes * rows * h * p_bytes / hbm
    copies = rows * (m.moe_router_topk or 0)
    w.elementwise_s += w.moe_layers * value("moe_permute_passes") * copies * routed_width(m) * p_bytes / hbm
    # the experts' activation on every routed copy (fused SwiGLU, or an unfused GLU: clamped or not SiLU)
    fused = bias_activation_fusion(m, lay.on_gpu, lay.use_te)
    act_passes = value("moe_act_passes" if fused else "moe_act_passes_unfused")
    w.elementwise_s += w.moe_layers * act_passes * copies * (m.moe_ffn_hidden_size or 0) / lay.etp * p_bytes / hbm
    # what `layernorm` / `moe_act` recompute would run again: the two norms' forward (read and write h each), the
    # experts' activation forward (read 2·f_e, write f_e per routed copy)
    w.norm_s = w.blocks * 2 * rows * h * p_bytes / hbm
    w.moe_act_s = w.moe_layers * 3 * copies * (m.moe_ffn_hidden_size or 0) * p_bytes / hbm
    local_experts = (m.num_moe_experts or 0) // lay.ep
    kernels, captured = kernel_counts(perf, w.layers - w.moe_layers, w.moe_layers, local_experts, kinds)
    # the host launches eager kernels at `launch_us`, those a CUDA graph captures at `launch_us_cuda_graphs`; the GPU
    # spends `kernel_gpu_us` on each, captured or not
    w.host_s = ((kernels - captured) * value("launch_us") + captured * value("launch_us_cuda_graphs")) * 1e-6
    w.kernel_s = kernels * value("kernel_gpu_us") * 1e-6
    return w


def layer_kinds(m: ModelConfig, lay: Layout, pp_rank: int) -> Counter | None:
    """A hybrid model's layers on pipeline rank `pp_rank`, by pattern symbol (`model_providers.core.hybrid`); None for
    a transformer."""
    if not hybrid.is_hybrid(m):
        return None
    kinds: Counter = Counter()
    for v in range(lay.vp):
        offset, n = lay.chunk_layers(m.num_layers, pp_rank, v)
        kinds.update(m.hybrid_layer_pattern[offset:offset + n])
    if pp_rank == lay.pp - 1:  # the MTP depths (model.mtp_layer_pattern × model.mtp_num_layers) after the last layer
        kinds.update(hybrid.mtp_counts(m))
    return kinds


def computed_keys(m) -> float:
    """Keys per query fused attention computes, averaged over the layers: whole tiles of `attention_tile` keys — a
    causal layer s/2 + T/2 (its diagonal tiles whole), a window of W keys W + T (the tiles it overlaps)."""
    s, tile = m.seq_length, value("attention_tile")
    full = s / 2 + tile / 2
    size = window_size(m)
    if size is None:
        return full
    windowed = sum(windowed_layers(m))
    return (windowed * min(full, size[0] + 1 + tile) + (m.num_layers - windowed) * full) / m.num_layers


def kernel_counts(perf: PerformanceConfig, dense_layers: int, moe_layers: int, local_experts: int = 0,
                  kinds: Counter | None = None) -> tuple[float, float]:
    """(kernels of one microbatch, those a CUDA graph captures): what the host launches and the GPU runs. Without a
    scope a graph captures every layer (Megatron-Bridge's full-iteration graph likewise); a scope captures its modules'
    kernels only (attn: the attention block of every layer; mlp: a dense layer's MLP; moe: a MoE layer's MLP;
    moe_router, moe_preprocess: those of every MoE layer; mamba: a hybrid model's Mamba layers). `kinds`: a hybrid
    model's layers by symbol (each one block: an attention block, an MLP or MoE block without attention, a Mamba
    layer). `perf`: the performance section."""
    dense_k, attn_k = value("kernels_per_dense_layer"), value("kernels_attention")
    moe_k = value("kernels_per_moe_layer") + local_experts * value("kernels_per_local_expert")
    n_attn, n_mamba = dense_layers + moe_layers, 0
    if kinds is not None:  # blocks: an MLP / MoE block has no attention, attention blocks stand alone
        n_attn, n_mamba = kinds[hybrid.ATTENTION], kinds[hybrid.MAMBA]
        dense_layers = kinds[hybrid.MLP]
    total = dense_layers * dense_k + moe_layers * moe_k + n_mamba * value("kernels_mamba")
    if kinds is not None:
        total += n_attn * attn_k - (dense_layers + moe_layers) * attn_k
    captured = 0.0
    if perf.cuda_graph_impl != "none" and not perf.cuda_graph_scope:
        captured = total
    elif perf.cuda_graph_impl != "none":
        scope = set(perf.cuda_graph_scope or ())
        captured += n_attn * attn_k if "attn" in scope else 0.0
        captured += n_mamba * value("kernels_mamba") if "mamba" in scope else 0.0
        captured += dense_layers * (dense_k - attn_k) if "mlp" in scope else 0.0
        if "moe" in scope:
            captured += moe_layers * (moe_k - attn_k)
        else:
            captured += moe_layers * sum(value(f"kernels_{s}") for s in ("moe_router", "moe_preprocess") if s in scope)
    return total, captured


def recompute_factor(m: ModelConfig, work: RankWork | None = None) -> float:
    """Extra compute of recomputation, as a factor on a microbatch (full: the forward again, ~1/3)."""
    if m.recompute_granularity == "full":
        return 4 / 3
    modules = recomputed_modules(m)
    extra = recompute_shares(m, modules)  # mla_up_proj, shared_experts, a dense-first model's mlp: from FLOPs
    if "moe" in modules or ("mlp" in modules and not m.num_moe_experts):
        extra += value("recompute_mlp_extra")
    if "core_attn" in modules:
        extra += value("recompute_core_attn_extra")
    if work is not None and work.busy_s > 0:  # memory-bound forwards again: the norms, the experts' activation
        extra += (work.norm_s * ("layernorm" in modules) + work.moe_act_s * ("moe_act" in modules)) / work.busy_s
    return 1 + extra
