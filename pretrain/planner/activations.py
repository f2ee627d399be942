"""Activations: what autograd keeps per layer and per microbatch, and the most a pipeline stage holds.

Every term is a tensor that a Megatron-Core / Transformer Engine / torch autograd node saves for backward,
counted once per storage (views share it). Notation: s = sequence / CP, b = micro batch, h hidden, a heads,
g query groups, d head dim, f FFN size, t = TP, p = bytes per value; `hs` = s·b·h, divided by t with
sequence parallelism; `rows` = hs / h. The local-spec terms were measured on CPU ranks (see
`pretrain.planner.measure` and tests/pretrain/test_plan.py); GPU-only paths (Transformer Engine, fused
kernels) come from their source, cited in docs/performance.md.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

from model_providers.core import hybrid
from model_providers.core.fusions import bias_activation_fusion
from model_providers.core.model_plan import ModelPlan, model_plan
from pretrain.config import Config, ModelConfig, PerformanceConfig
from pretrain.layout import Layout
from pretrain.planner import linear_attention, mamba
from pretrain.planner.census import is_moe_layer, routed_width
from pretrain.planner.context import (
    cpu_attention_terms,
    cpu_attention_working_set,
    cpu_recompute_working_set,
    uses_cpu_cp_attention,
)
from pretrain.planner.mla import mla_terms, mtp_extras, shared_expert_terms, sigmoid_router_terms
from pretrain.planner.precision import gemm_input_bytes


def _qkv_saved_units(a: int, g: int, rope: bool, expanded: bool) -> int:
    """Q, K, V kept for attention's backward, in units of s·b·d/t values.

    Local attention expands K and V to all heads (GQA) and keeps the expanded copies. Fused attention
    and the selective-recompute checkpoint keep Q, K and V as given: RoPE makes new Q and K; V is a view
    of the fused QKV output, which therefore stays alive whole (a + 2g).
    """
    if expanded and g < a:
        return 3 * a
    mixed = a + 2 * g
    if rope:
        return a + g + mixed
    return mixed + (a if g < a else 0)  # GQA: reshaping Q out of the grouped layout copies it


def _norm_terms(m: ModelConfig, lay: Layout, hs: int, rows: int, gemm_bytes: float | None) -> int:
    """One norm and the column-parallel GEMM it feeds: what both keep.

    Fused norms (Transformer Engine's LayerNormLinear, torch's CUDA RMSNorm/LayerNorm kernels) keep their
    input and fp32 statistics (rstd; LayerNorm also the mean); the GEMM keeps the norm output (an FP8 copy
    under FP8). On CPU, torch's RMSNorm is composite: an fp32 copy of the input, rstd, and the fp32
    normalised value (and the weight-scaled output, in the input's dtype, is the GEMM input); LayerNorm keeps
    its input and mean/rstd in the input's dtype. `gemm_bytes`: the GEMM's low-precision copy (`gemm_input_bytes`).
    """
    p = lay.bytes_per_value
    layer_norm = m.normalization == "LayerNorm"
    gemm_in = int(hs * (gemm_bytes or p))
    if lay.on_gpu:
        return hs * p + rows * 4 * (2 if layer_norm else 1) + gemm_in
    if layer_norm:
        return hs * p + 2 * rows * p + gemm_in
    return 8 * hs + 4 * rows + gemm_in


def recomputed_modules(m: ModelConfig) -> frozenset[str]:
    """What selective recompute recomputes: `model.recompute_modules` (Megatron-Core's default: core_attn)."""
    if m.recompute_granularity != "selective":
        return frozenset()
    return frozenset(m.recompute_modules if m.recompute_modules is not None else ("core_attn",))


def layer_terms(mp: ModelPlan, lay: Layout, recompute_core_attention: bool = False,
                modules: Collection[str] = (), index: int | None = None) -> dict[str, int]:
    """Bytes one decoder layer keeps for one microbatch, by term (no full recompute), of the model `mp` builds (its
    model section, performance section, packed documents, CP communication).

    `modules`: selectively recomputed submodules (`recomputed_modules`); `core_attn` there is the same as
    `recompute_core_attention`. `mlp`: the checkpoint keeps only the MLP's input, already the fc1 GEMM input.
    `layernorm` (local spec; TE fuses its norms): each norm keeps only its input, the checkpoint's; its output and
    statistics are freed and rebuilt in backward. `index`: the global layer (dense or MoE in dense-first models;
    None: MoE whenever the model has experts).
    """
    recompute_core_attention = recompute_core_attention or "core_attn" in modules
    m = mp.config
    p = lay.bytes_per_value
    h, a = m.hidden_size, m.num_attention_heads
    g, d, f = lay.num_query_groups, lay.head_dim, lay.ffn_hidden_size
    s, b, t = m.seq_length // lay.cp, lay.mbs, lay.tp
    hs = s * b * h // (t if lay.sp else 1)
    rows = hs // h
    rope = m.position_embedding_type in ("rope", "yarn")  # YaRN is RoPE with other frequencies
    low = gemm_input_bytes(m, mp.performance, lay)
    sbd = s * b * d // t  # one head's worth of values on this rank, times t
    out: dict[str, int] = {"norms_and_gemm_inputs": 2 * _norm_terms(m, lay, hs, rows, low)}
    moe = bool(m.num_moe_experts) if index is None else is_moe_layer(m, index)
    if m.multi_latent_attention:
        out.update(mla_terms(m, lay, lambda n, r: _norm_terms(m, lay, n, r, low), recompute_core_attention,
                             up_proj="mla_up_proj" in modules))
        sbd = s * b * m.v_head_dim // t  # the attention output's head width is the value's
    elif recompute_core_attention:
        # The selective-recompute checkpoint keeps Q, K, V as given (see _qkv_saved_units).
        out["qkv"] = _qkv_saved_units(a, g, rope, expanded=False) * sbd * p
        if not lay.use_te and rope:
            out["rope_cos_sin"] = 4 * s * d * p
    elif lay.use_te:
        # TE fused attention keeps Q, K, V (made contiguous unless they match a packed layout: a + 2g heads),
        # and the fp32 softmax statistics; TE's fused RoPE keeps only the shared frequencies.
        out["qkv"] = (a + 2 * g) * sbd * p
        out["softmax_stats"] = 4 * b * (a // t) * s
    elif uses_cpu_cp_attention(mp, lay):
        # The local spec's context-parallel / packed-sequence attention (pretrain.planner.context).
        out.update(cpu_attention_terms(mp, lay, sbd, _qkv_saved_units(a, g, rope, expanded=False),
                                       _qkv_saved_units(a, g, rope, expanded=True)))
        if rope:
            out["rope_cos_sin"] = 4 * s * d * p
    else:
        # Local attention: K/V expanded to all heads, the causal mask, the fp32 softmax and its p-byte copy.
        out["qkv"] = _qkv_saved_units(a, g, rope, expanded=True) * sbd * p
        if rope:
            out["rope_cos_sin"] = 4 * s * d * p  # cos and sin, for Q and for K, per layer
        out["causal_mask"] = s * s
        out["scores"] = (4 + (p if p != 4 else 0)) * b * (a // t) * s * s
    # The attention output: kept by attention (TE) and the output projection (an FP8 copy under FP8; with
    # core attention recomputed, only the projection's copy remains).
    kept = (low if recompute_core_attention else p + low) if low else p
    out["attention_output"] = int(a * sbd * kept)
    out = linear_attention.adjust_attention_terms(out, m, lay, index)  # Gated DeltaNet layers, the output gate
    fc2_in = low or p
    if moe:
        out.update(moe_terms(m, mp.performance, lay, rows, modules))
    else:
        sbf = s * b * f // t
        if m.gated_linear_unit:
            if bias_activation_fusion(m, lay.on_gpu, lay.use_te):
                out["mlp"] = int(sbf * (2 * p + fc2_in))  # fused SwiGLU keeps its input; fc2 its own input
            else:
                out["mlp"] = int(sbf * (4 * p + fc2_in))  # fc1 output, silu(x1), x2 + 0, fc2 input
        else:
            out["mlp"] = int(sbf * (p + fc2_in))  # GELU input (fc1 output + bias), fc2 input
        if "mlp" in modules:
            out["mlp"] = 0
    if "layernorm" in modules and not lay.use_te:
        out["norms_and_gemm_inputs"] = 2 * hs * p
    return out


def moe_terms(m: ModelConfig, perf: PerformanceConfig, lay: Layout, tokens: int,
              modules: Collection[str] = ()) -> dict[str, int]:
    """What an MoE layer's router, dispatcher and experts keep for one microbatch of `tokens` on this rank (`m`,
    `perf`: the model and performance sections).

    Measured on CPU ranks (local spec, `SequentialMLP`, dropless, fp32 and bf16, varying h, f_e, E, k): the
    router keeps fp32 logits and index/mask tensors, 5·T·E + 24·T·k bytes, plus 4·T·E + 8·T·k + 8·E + 4 with
    the load-balancing loss and 4·T·E + 4·T + 4 with the z-loss; the experts keep, per routed token copy, the
    dispatched input (h) and six f_e-wide values (fc1's output, the activation, the gated product, the input
    of fc2, ...) in the activation dtype (TE's grouped GEMM with the fused SwiGLU: three, see below). A rank's
    experts get T·k·ETP copies (expert TP gathers the tokens of its group) of width f_e / ETP, counted as if
    routing were balanced across expert-parallel ranks (measured at EP2: the group's mean exact, ranks ±3%).

    `modules`: `moe` checkpoints the whole layer (Megatron-Core's `MoELayer`), which keeps only its input, the
    pre-MLP norm's output already counted with the norms: nothing here. `moe_act` (grouped GEMM only, GPU)
    discards the activation's output, fc2's input: f_e / ETP values per copy fewer (from the source, not measured).
    """
    if "moe" in modules:
        return {"moe_router": 0, "moe_experts": 0}
    p = lay.bytes_per_value
    experts, k = m.num_moe_experts, m.moe_router_topk
    sigmoid = m.moe_router_score_function == "sigmoid"
    if sigmoid:  # DeepSeek routing (pretrain.planner.mla)
        router = sigmoid_router_terms(m, lay, tokens)
    else:
        router = 5 * tokens * experts + 24 * tokens * k
        if m.moe_aux_loss_coeff > 0 and m.moe_router_load_balancing_type != "none":
            router += 4 * tokens * experts + 8 * tokens * k + 8 * experts + 4
        if m.moe_z_loss_coeff:
            router += 4 * tokens * experts + 4 * tokens + 4
    out = {"moe_router": router}
    if m.moe_shared_expert_intermediate_size and "shared_experts" not in modules:  # its checkpoint keeps its input
        out["moe_shared_experts"] = shared_expert_terms(m, perf, lay, bias_activation_fusion(m, lay.on_gpu, lay.use_te))
    width = lay.moe_ffn_hidden_size // lay.etp
    grouped = lay.use_te if m.moe_grouped_gemm is None else m.moe_grouped_gemm
    probs = 4 * tokens * k if sigmoid else 0  # the renormalised sigmoid weights the experts multiply by (fp32)
    gemm_in = gemm_input_bytes(m, perf, lay) or p  # a GEMM input as kept: its FP8 copy under FP8 (TE)
    routed = routed_width(m)
    if m.moe_latent_size:
        # LatentMoE (Megatron-Core's `MoELayer`, TE only, not measured): `fc2_latent_proj` keeps its input, every
        # token's combined latent-width output; `fc1_latent_proj`'s input is the pre-MLP norm's output (counted with
        # the norms) and its output is what the dispatcher copies (below).
        out["moe_latent"] = int(tokens * m.moe_latent_size * gemm_in)
    if grouped and m.gated_linear_unit and bias_activation_fusion(m, lay.on_gpu, lay.use_te):
        # TE grouped GEMM (from the source, not measured): fc1 keeps its input (h), the fused weighted SwiGLU its
        # input (2·f_e) and the fp32 probability, fc2 its input (f_e).
        # Under FP8 (TE) the two GEMM inputs are kept as their FP8 copies, as in the dense MLP.
        per_copy = (routed + (0 if "moe_act" in modules else width)) * gemm_in + 2 * width * p
        return {**out, "moe_experts": int(tokens * k * lay.etp * (per_copy + 4))}
    if grouped and lay.use_te and not m.gated_linear_unit:
        # TE grouped GEMM with a plain activation (Nemotron 3's squared ReLU; from the source, not measured): fc1 keeps
        # its input, the activation its input (fc1's output), fc2 its input (the activation's output, which `moe_act`
        # recompute discards).
        per_copy = routed * gemm_in + width * p + (0 if "moe_act" in modules else width * gemm_in)
        return {**out, "moe_experts": int(tokens * k * lay.etp * per_copy)}
    # Unfused: fc1's input and output, the activation's intermediates, fc2's input (6·f_e gated, 3·f_e not); with the
    # activation recomputed (moe_act) only its input, fc1's output, stays (2·f_e gated, f_e not).
    act = (2 if m.gated_linear_unit else 1) if "moe_act" in modules else (6 if m.gated_linear_unit else 3)
    return {**out, "moe_experts": tokens * k * lay.etp * (routed + act * width) * p + probs * lay.etp}


def layer_activation_bytes(cfg: Config, lay: Layout, recompute_core_attention: bool = False,
                           modules: Collection[str] = (), index: int | None = None) -> int:
    """Bytes autograd keeps for one decoder layer and one microbatch (no full recompute; `cfg`: what `model_plan`
    reads of it)."""
    return sum(layer_terms(model_plan(cfg), lay, recompute_core_attention, modules, index).values())


def stage_layers(cfg: Config, lay: Layout, pp_rank: int, vp_stage: int, modules: Collection[str] = ()) -> list[int]:
    """Bytes each transformer layer of one model chunk keeps per microbatch, in order: its decoder layers, then
    (last stage, last chunk) the MTP layers' transformer layers (like the decoder's last). `cfg`: what `model_plan`
    reads of it."""
    return chunk_layer_bytes(model_plan(cfg), lay, pp_rank, vp_stage, modules)


def chunk_layer_bytes(mp: ModelPlan, lay: Layout, pp_rank: int, vp_stage: int,
                      modules: Collection[str] = ()) -> list[int]:
    """`stage_layers` of the model `mp` builds."""
    m = mp.config
    offset, per_chunk = lay.chunk_layers(m.num_layers, pp_rank, vp_stage)
    if hybrid.is_hybrid(m):  # Mamba / attention / MLP / MoE layers (pretrain/planner/mamba.py); MTP depths last
        mtp = pp_rank == lay.pp - 1 and vp_stage == lay.vp - 1
        return mamba.stage_layers(mp, lay, offset, per_chunk, modules, layer_terms, _norm_terms, mtp)
    out = [sum(layer_terms(mp, lay, modules=modules, index=offset + i).values()) for i in range(per_chunk)]
    if m.mtp_num_layers and pp_rank == lay.pp - 1 and vp_stage == lay.vp - 1:
        out += [sum(layer_terms(mp, lay, modules=modules, index=m.num_layers - 1).values())] * m.mtp_num_layers
    return out


def microbatch_extras(m: ModelConfig, perf: PerformanceConfig, lay: Layout, padded_vocab: int) -> tuple[int, int]:
    """(first stage, last stage) bytes outside the decoder layers, per microbatch.

    First: the token ids (and position ids) the embedding keeps (int64). Last: the final norm and output
    layer inputs, the vocab-parallel cross entropy's fp32 softmax over V/t (not with Transformer Engine's fused
    cross entropy, `performance.cross_entropy_fusion_impl=te`: it writes the gradient into the logits) plus its
    target mask (bool) and masked targets (int64), and the loss mask the loss function multiplies by (fp32).
    """
    s, b, t = m.seq_length // lay.cp, lay.mbs, lay.tp
    hs = s * b * m.hidden_size // (t if lay.sp else 1)
    first = 8 * s * b * (2 if m.position_embedding_type == "learned_absolute" else 1)
    last = _norm_terms(m, lay, hs, hs // m.hidden_size, gemm_bytes=None)  # the output layer is not FP8
    te_loss = lay.on_gpu and lay.use_te and perf.cross_entropy_fusion_impl == "te"
    last += (0 if te_loss else 4 * s * b * (padded_vocab // t)) + 9 * s * b + 4 * s * b
    return first, last


def _full_recompute(m: ModelConfig, per_chunk: int, layer: int, hs_bytes: int) -> tuple[int, int, int]:
    """(bytes kept per chunk-microbatch, recompute working set, layers freed before it) for full recompute."""
    n = max(1, m.recompute_num_layers or 1)
    if m.recompute_method == "block":
        k = min(n, per_chunk)
        # The last per_chunk - k layers are not recomputed and are backwarded first.
        return k * hs_bytes + (per_chunk - k) * layer, (layer if k else 0), (per_chunk - k) * layer
    groups = math.ceil(per_chunk / n)
    return groups * hs_bytes, min(n, per_chunk) * layer, 0


def _selective_recompute(mp: ModelPlan, lay: Layout, modules: Collection[str]) -> tuple[int, int]:
    """(recomputed working set, bytes freed before it) in the backward of the last layer.

    Without core_attn: the MLP (recomputed first in the layer's backward, nothing freed yet) or the norms'
    outputs, whichever is larger. With it: the MLP half of the layer (second norm, fc1/fc2 inputs, activation)
    and the output projection's input are released before core attention is recomputed. Local attention then
    rebuilds the expanded K/V (GQA), the causal mask and the scores; TE's fused attention a contiguous V and its
    softmax statistics.
    """
    full = layer_terms(mp, lay)
    mlp = full["mlp"] if "mlp" in full else full["moe_router"] + full["moe_experts"] + full.get("moe_shared_experts", 0)
    up_proj = full.get("qkv", 0) + full.get("mla_latents", 0) if "mla_up_proj" in modules else 0
    if "core_attn" not in modules:
        norms = full["norms_and_gemm_inputs"] - layer_terms(mp, lay, modules=("layernorm",))[
            "norms_and_gemm_inputs"]
        shared = full.get("moe_shared_experts", 0) if "shared_experts" in modules else 0
        return max(mlp if {"mlp", "moe"} & set(modules) else 0, norms // 2 if "layernorm" in modules else 0,
                   up_proj, shared), 0
    kept = layer_terms(mp, lay, recompute_core_attention=True)
    freed = full["norms_and_gemm_inputs"] // 2 + mlp + kept["attention_output"]
    m = mp.config
    a = m.num_attention_heads
    g, d = lay.num_query_groups, lay.head_dim
    head = (m.seq_length // lay.cp) * lay.mbs * d // lay.tp * lay.bytes_per_value
    if lay.use_te:
        return g * head + full["softmax_stats"], freed
    if uses_cpu_cp_attention(mp, lay):
        return cpu_recompute_working_set(mp, lay, full, head), freed
    expanded = 2 * a * head if g < a else 0
    return expanded + full["causal_mask"] + full["scores"], freed


def _local_attention_backward(mp: ModelPlan, lay: Layout, modules: Collection[str]) -> tuple[int, int]:
    """(working set, bytes freed before it) of the local spec's attention backward in a stage's first backwarded
    layer: Megatron-Core's `FusedScaleMaskSoftmax` torch path saves the fp32 probabilities and their p-byte copy
    ("scores"); its backward holds the fp32 gradient of the probabilities and the fp32 gradient of the scores
    (8 bytes per score; 12 in fp32) once the p-byte copy's matmul has released it. Before it, the layer's MLP (or
    experts) and the output projection's input are released (hybrid models: nothing, conservatively). Checked on CPU
    with `logging.profile.memory` (tests/pretrain/test_plan.py): at 64 heads the peak is this backward's.
    """
    m = mp.config
    if lay.use_te or uses_cpu_cp_attention(mp, lay):
        return 0, 0
    index = None if hybrid.is_hybrid(m) else m.num_layers - 1
    scores = layer_terms(mp, lay, index=index).get("scores", 0)  # as saved without recompute
    if not scores:  # no softmax attention in that layer
        return 0, 0
    last = layer_terms(mp, lay, modules=modules, index=index)
    p = lay.bytes_per_value
    copy = p if p != 4 else 0
    per_score = scores // (4 + copy)
    freed = 0 if hybrid.is_hybrid(m) else (
        last.get("mlp", 0) + last.get("moe_router", 0) + last.get("moe_experts", 0)
        + last.get("moe_shared_experts", 0) + last.get("attention_output", 0))
    # fp32: no upcast copy, so the mask is written in place into a view of the scores; that view's backward
    # (CopySlices) clones the gradient of the whole scores tensor: one fp32 score tensor more
    return (12 if p == 4 else 8 - copy) * per_score, freed


def schedule(lay: Layout, pp_rank: int) -> list[tuple[str, int, int]]:
    """Megatron-Core's order of (forward "F" | backward "B", model chunk, microbatch) on one stage.

    No pipelining: F, B per microbatch. 1F1B: PP − rank − 1 warm-up forwards, then one forward and one
    backward at a time. Interleaved: the schedule table (groups of PP microbatches, chunk by chunk),
    2·(PP − rank − 1) + (V − 1)·PP warm-up forwards, then 1F1B; backward visits chunks in reverse.
    """
    m_total = lay.num_microbatches
    if lay.pp == 1:
        return [op for i in range(m_total) for op in (("F", 0, i), ("B", 0, i))]
    if lay.vp == 1:
        table = [(i, 0) for i in range(m_total)]
        warmup = min(lay.pp - pp_rank - 1, m_total)
    else:
        group = lay.pp
        table = []
        for lo in range(0, m_total, group):
            hi = m_total if lo + group >= m_total else lo + group
            table += [(i, c) for c in range(lay.vp) for i in range(lo, hi)]
        warmup = min((lay.pp - pp_rank - 1) * 2 + (lay.vp - 1) * group, len(table))
    ops: list[tuple[str, int, int]] = [("F", c, i) for i, c in table[:warmup]]
    for k in range(len(table) - warmup):
        i, c = table[k + warmup]
        ops.append(("F", c, i))
        i, c = table[k]
        ops.append(("B", lay.vp - 1 - c, i))
    ops += [("B", lay.vp - 1 - c, i) for i, c in table[len(table) - warmup:]]
    return ops


@dataclass
class ActivationMemory:
    saved: int  # the most bytes of stored activations held at once (after a forward)
    transient: int  # working buffers at the peak (includes `recompute`)
    recompute: int = 0  # extra bytes while a recomputed group's activations exist (full recompute)
    in_flight: dict[int, int] = field(default_factory=dict)  # chunk -> microbatches held at the peak

    @property
    def peak(self) -> int:
        """The most bytes autograd holds at once during the step."""
        return self.saved + self.recompute


def activation_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int) -> ActivationMemory:
    """Activations this pipeline stage holds at its peak, and the transient buffers then (`cfg`: what `model_plan`
    reads of it, the model the builder builds)."""
    mp = model_plan(cfg)
    m = mp.config
    p = lay.bytes_per_value
    h = m.hidden_size
    s, b, t = m.seq_length // lay.cp, lay.mbs, lay.tp
    hs = s * b * h // (t if lay.sp else 1)
    selective = m.recompute_granularity == "selective"
    modules = recomputed_modules(m)
    chunk_layers = {c: chunk_layer_bytes(mp, lay, pp_rank, c, modules) for c in range(lay.vp)}
    per_mb = {c: sum(layers) for c, layers in chunk_layers.items()}
    working, freed_first, once = 0, 0, 0
    if m.recompute_granularity == "full":
        # dense-first models: the larger layer (a chunk of a layout string may hold none: the loss alone)
        layer = max((max(layers) for layers in chunk_layers.values() if layers), default=0)
        per_mb, work = {}, []
        for c, layers in chunk_layers.items():
            decoder = lay.chunk_layers(m.num_layers, pp_rank, c)[1]
            stored, chunk_work, freed_first = _full_recompute(m, decoder, layer, hs * p)
            per_mb[c] = stored + (len(layers) - decoder) * 2 * hs * p  # MTP layers keep their two inputs
            work.append(chunk_work)
        working = max(work)
        if m.position_embedding_type in ("rope", "yarn"):  # checkpoints keep each chunk's (cached) RoPE frequencies
            once = lay.vp * s * lay.head_dim * 4
    elif selective:
        working, freed_first = _selective_recompute(mp, lay, modules)
    offloaded = mp.performance.cpu_offloading_num_layers
    in_transit = 0
    if offloaded and lay.pp == 1 and m.recompute_granularity is None:
        # Megatron-Core's layer-wise offloading (Transformer Engine's get_cpu_offload_context): the first N layers'
        # activations live in host memory between their forward and backward. TE 2.10+ (DefaultOffloadSynchronizer)
        # releases layer i's GPU copy before layer L − N + i's forward and starts its reload after layer L − N + i's
        # backward began: "peak memory usage of saving activations is (num_layers − num_offloaded_layers) · T". TE's
        # earlier path (cpu_offload_v1, the group window) releases the last offloaded layer at the last layer's
        # commit: one layer more, but only before the final norm, output layer and loss run (`in_transit` below).
        moved = chunk_layers[0][:offloaded]
        per_mb[0] -= sum(moved)
        in_transit = max(moved, default=0)
    first, last = microbatch_extras(m, mp.performance, lay, padded_vocab)
    last += mtp_extras(m, lay, padded_vocab, lambda n, r: _norm_terms(m, lay, n, r, gemm_bytes=None))
    loss_chunk = lay.vp - 1 if pp_rank == lay.pp - 1 else None
    if pp_rank == 0:
        per_mb[0] += first
    if loss_chunk is not None:
        per_mb[loss_chunk] += last
    attn_working, attn_freed = _local_attention_backward(mp, lay, modules)
    if selective and "core_attn" in modules:  # recomputed scores, then their backward; nothing more freed
        attn_working, attn_freed = working + attn_working, freed_first
    elif m.recompute_granularity == "full":
        attn_working, attn_freed = working + attn_working, freed_first + attn_freed
    live: dict[int, int] = {}
    current = saved = once
    extra = attn = 0
    peak_flight: dict[int, int] = {}
    for op, chunk, _ in schedule(lay, pp_rank):
        if op == "F":
            live[chunk] = live.get(chunk, 0) + 1
            current += per_mb[chunk]
            if current > saved:
                saved, peak_flight = current, dict(live)
        else:
            freed = freed_first + (last if chunk == loss_chunk else 0)
            extra = max(extra, current - freed + working - saved)
            if attn_working:
                attn = max(attn, current - attn_freed - (freed - freed_first) + attn_working - saved)
            live[chunk] -= 1
            current -= per_mb[chunk]
    after_loss = max(0, extra)
    if pp_rank == lay.pp - 1:
        logits = s * b * (padded_vocab // t) * p  # the logits themselves, alive through the loss
        after_loss += max(logits, in_transit)  # (TE < 2.10's offloaded layer in transit comes before them)
    # the local attention's backward comes after the loss (its logits freed)
    transient = max(after_loss, attn) + 2 * hs * p  # pipeline send/receive (or the stage input/output)
    if hybrid.is_hybrid(m):  # a Mamba scan's chunk states while it runs
        transient += mamba.scan_states(m, lay)
    # the sequence-parallel all-gather buffer; with TP communication overlap the gathered input is TE's userbuffer
    # (`planner.memory.userbuffer_bytes`), not a tensor of its own
    overlap = mp.tp_comm_overlap and lay.use_te and lay.tp > 1
    gather = s * b * h * p if lay.sp and not overlap else 0
    if uses_cpu_cp_attention(mp, lay):
        gather = max(gather, cpu_attention_working_set(mp, lay))  # CPU only: its s²/CP scores while it runs
    elif not lay.use_te and "core_attn" not in modules:
        gather = max(gather, b * (m.num_attention_heads // t) * s * s * p)  # shared with the score buffer
    transient += gather
    return ActivationMemory(saved=saved, transient=transient, recompute=max(0, extra),
                            in_flight={c: n for c, n in sorted(peak_flight.items()) if n})


def in_flight(lay: Layout, pp_rank: int) -> dict[int, int]:
    """Microbatches each model chunk of this stage holds at its peak (most chunk-microbatches at once)."""
    live: dict[int, int] = {}
    best: dict[int, int] = {}
    for op, chunk, _ in schedule(lay, pp_rank):
        live[chunk] = live.get(chunk, 0) + (1 if op == "F" else -1)
        if op == "F" and sum(live.values()) > sum(best.values()):
            best = dict(live)
    return {c: n for c, n in sorted(best.items()) if n}
