"""Know before you launch: per-GPU memory, FLOPs and throughput of a config on a cluster.

    python -m pretrain plan CONFIG [overrides] --nodes N --gpus-per-node G [--gpu h100] [--json] [--search]

Memory per rank is computed from the shapes Megatron-Core allocates, not from rules of thumb:

- weights: every parameter of this rank's model chunks (the tensor-parallel shard of each matrix, this
  pipeline stage's layers, embedding on the first stage, output layer on the last); with the distributed
  optimizer the DDP contiguous parameter buffer, padded as Megatron pads it.
- gradients: DDP's contiguous gradient buffers (fp32 with optimizer.grad_reduce_in_fp32), padded likewise.
- optimizer: Adam's two fp32 moments plus fp32 main parameters (bf16/fp16 only) for the elements this
  rank owns — all of them, or its data-parallel(×context-parallel) shard of every DDP bucket with the
  distributed optimizer.
- activations: what autograd keeps per microbatch per layer (see `layer_activation_bytes`), times the
  microbatches in flight on this stage under 1F1B (interleaving keeps more), with sequence parallelism,
  context parallelism and recomputation applied; plus the embedding/loss extras of first/last stages.
- fp8: Transformer Engine's FP8 copy and transposed copy of every linear weight.
- buffers: transient working memory at the backward peak (sequence-parallel all-gather buffer, local
  attention's score buffer, pipeline send/receive buffers, the bf16 logits, one weight gradient before it is
  accumulated into the fp32 buffer, one recomputed group).

Not modelled: the CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation (the planner keeps
`HEADROOM` of the GPU free for them).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from pretrain.config import Config, ConfigError, load_config
from pretrain.flops import PEAK_TFLOPS, flops_per_token

GIB = 2**30

# Usable device memory as torch reports it (GiB), and per-GPU link bandwidths (GB/s, one direction).
GPU_MEMORY_GIB = {"h100": 79.6, "h200": 140.4, "b200": 178.4, "a100": 79.2}
NVLINK_GBPS = {"h100": 450.0, "h200": 450.0, "b200": 900.0, "a100": 300.0}
NETWORK_GBPS = {"h100": 50.0, "h200": 50.0, "b200": 100.0, "a100": 25.0}  # one 400/800 Gb/s NIC per GPU
HEADROOM = 0.90  # a layout fits when its planned peak is below this fraction of GPU memory
DEFAULT_MFU = 0.40
GEMM_EFFICIENCY = 0.60  # cost model: fraction of peak the model's GEMMs reach without bubbles/communication

FORMULA = ("F/token = 12·L·h²·[(1 + g/a + s/(2h))·(a·d/h) + (f/h)·(3/2 if gated else 1) + V/(2·L·h)] "
           "(Megatron's accounting: fwd+bwd = 3 GEMMs, causal attention halved; recompute not counted)")


class PlanError(ValueError):
    """A plan request that cannot be answered (bad layout, unknown GPU, ...)."""


# --------------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------------


@dataclass
class Layout:
    """The parallel layout and numerics a plan is made for."""

    world: int
    tp: int
    pp: int
    vp: int  # 1 without interleaving
    cp: int
    dp: int
    sp: bool
    mbs: int
    gbs: int
    precision: str  # "bf16" | "fp16" | "fp32"
    distributed: bool
    use_te: bool

    @property
    def num_microbatches(self) -> int:
        return self.gbs // (self.mbs * self.dp)

    @property
    def bytes_per_value(self) -> int:
        return 4 if self.precision == "fp32" else 2


def layout_of(cfg: Config, world: int, *, on_gpu: bool = True, use_te: bool | None = None) -> Layout:
    """The layout of `cfg` on `world` ranks (precision 'auto' is bf16 on GPU, fp32 on CPU)."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor * p.pipeline * p.context
    if world % model_parallel:
        raise PlanError(f"world size {world} is not divisible by tensor×pipeline×context = {model_parallel}")
    precision = t.precision if t.precision != "auto" else ("bf16" if on_gpu else "fp32")
    if use_te is None:
        use_te = on_gpu and cfg.model.transformer_impl != "local"
    return Layout(world=world, tp=p.tensor, pp=p.pipeline, vp=p.virtual_pipeline or 1, cp=p.context,
                  dp=world // model_parallel, sp=p.sequence_parallel, mbs=t.micro_batch_size,
                  gbs=t.global_batch_size, precision=precision, distributed=cfg.optimizer.distributed,
                  use_te=use_te)


# --------------------------------------------------------------------------------------------------
# Parameters, DDP buffers and optimizer state
# --------------------------------------------------------------------------------------------------


@dataclass
class Param:
    name: str
    numel: int
    linear: bool = False  # a transformer-layer GEMM weight (FP8-cast by Transformer Engine)
    shared_embedding: bool = False  # Megatron puts it in its own bucket with the distributed optimizer


def _norm_params(prefix: str, m: Any) -> list[Param]:
    out = [Param(f"{prefix}.weight", m.hidden_size)]
    if m.normalization == "LayerNorm":
        out.append(Param(f"{prefix}.bias", m.hidden_size))
    return out


def layer_parameters(m: Any, tp: int, index: int) -> list[Param]:
    """One decoder layer's parameters on one TP rank, in Megatron's local-spec registration order."""
    h, a = m.hidden_size, m.num_attention_heads
    g = m.num_query_groups or a
    d = m.kv_channels or h // a
    f = m.ffn_hidden_size or 4 * h
    pre = f"decoder.layers.{index}"
    out = _norm_params(f"{pre}.input_layernorm", m)
    out.append(Param(f"{pre}.self_attention.linear_proj.weight", h * a * d // tp, linear=True))
    if m.add_bias_linear:
        out.append(Param(f"{pre}.self_attention.linear_proj.bias", h))
    qkv = (a + 2 * g) * d // tp
    out.append(Param(f"{pre}.self_attention.linear_qkv.weight", qkv * h, linear=True))
    if m.add_bias_linear or m.add_qkv_bias:
        out.append(Param(f"{pre}.self_attention.linear_qkv.bias", qkv))
    if m.qk_layernorm:  # per-head norms of queries and keys, replicated across TP
        out += [Param(f"{pre}.self_attention.{n}_layernorm.weight", d) for n in ("q", "k")]
    out += _norm_params(f"{pre}.pre_mlp_layernorm", m)
    fc1 = (2 if m.gated_linear_unit else 1) * f // tp
    out.append(Param(f"{pre}.mlp.linear_fc1.weight", fc1 * h, linear=True))
    if m.add_bias_linear:
        out.append(Param(f"{pre}.mlp.linear_fc1.bias", fc1))
    out.append(Param(f"{pre}.mlp.linear_fc2.weight", h * f // tp, linear=True))
    if m.add_bias_linear:
        out.append(Param(f"{pre}.mlp.linear_fc2.bias", h))
    return out


def chunk_parameters(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int, vp_stage: int) -> list[Param]:
    """Parameters of one model chunk (`GPTModel`) in `named_parameters()` order."""
    m = cfg.model
    pre = pp_rank == 0 and vp_stage == 0
    post = pp_rank == lay.pp - 1 and vp_stage == lay.vp - 1
    tied = m.share_embeddings_and_output_weights
    out: list[Param] = []
    if pre:
        out.append(Param("embedding.word_embeddings.weight", padded_vocab // lay.tp * m.hidden_size,
                         shared_embedding=tied and lay.pp > 1 and not post))
        if m.position_embedding_type == "learned_absolute":
            out.append(Param("embedding.position_embeddings.weight",
                             (m.max_position_embeddings or m.seq_length) * m.hidden_size))
    per_chunk = m.num_layers // (lay.pp * lay.vp)
    for i in range(per_chunk):
        out += layer_parameters(m, lay.tp, i)
    if post:
        out += _norm_params("decoder.final_layernorm", m)
        if not (tied and pre):
            out.append(Param("output_layer.weight", padded_vocab // lay.tp * m.hidden_size,
                             shared_embedding=tied and not pre))
    return out


def count_parameters(cfg: Config, padded_vocab: int) -> int:
    """Parameters of the whole model (one copy of tied embeddings)."""
    lay = Layout(world=1, tp=1, pp=1, vp=1, cp=1, dp=1, sp=False, mbs=1, gbs=1, precision="bf16",
                 distributed=False, use_te=False)
    return sum(p.numel for p in chunk_parameters(cfg, lay, padded_vocab, 0, 0))


@dataclass
class Buffer:
    """A simulated DDP `_ParamAndGradBuffer`: total elements, buckets, and each parameter's range."""

    numel: int
    buckets: list[tuple[int, int]]
    ranges: list[tuple[int, int, int]]  # (start, end, bucket) per parameter, in buffer order


def ddp_buffer(params: list[Param], dp_cp: int, distributed: bool, bucket_size: int | None) -> Buffer:
    """Megatron-Core's buffer layout: parameters in reverse order; with the distributed optimizer each
    parameter starts 64-element aligned and each bucket ends on a multiple of lcm(DP×CP, 128)."""

    def pad(n: int, k: int) -> int:
        return -(-n // k) * k

    bucket_div = math.lcm(dp_cp, 128)
    buckets: list[tuple[int, int]] = []
    ranges: list[tuple[int, int, int]] = []
    start = bucket_start = 0
    end = 0
    in_bucket = 0

    def close(end_index: int) -> int:
        nonlocal bucket_start, in_bucket
        bucket_end = pad(end_index, bucket_div) if distributed else end_index
        buckets.append((bucket_start, bucket_end))
        bucket_start, in_bucket = bucket_end, 0
        return bucket_end

    for p in reversed(params):
        if distributed:
            start = pad(start, 64)
        own_bucket = p.shared_embedding and distributed
        if own_bucket and in_bucket:
            start = close(start)
        end = start + p.numel
        ranges.append((start, end, len(buckets)))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    total = buckets[-1][1] if buckets else 0
    return Buffer(total, buckets, ranges)


def optimizer_elements(buf: Buffer, dp_cp: int, distributed: bool) -> list[int]:
    """Elements of optimizer state held by each data-parallel rank for one buffer."""
    real = sum(e - s for s, e, _ in buf.ranges)
    if not distributed:
        return [real] * dp_cp
    per_rank = [0] * dp_cp
    for s, e, b in buf.ranges:
        b_start, b_end = buf.buckets[b]
        shard = (b_end - b_start) // dp_cp
        for r in range(dp_cp):
            lo, hi = b_start + r * shard, b_start + (r + 1) * shard
            per_rank[r] += max(0, min(e, hi) - max(s, lo))
    return per_rank


@dataclass
class StaticMemory:
    """Bytes of weights, gradients and optimizer state on one rank (all of its chunks)."""

    params: int  # parameter elements (unpadded)
    weights: int
    gradients: int
    optimizer_moments: int
    optimizer_main_params: int
    fp8: int
    largest_param: int

    @property
    def optimizer(self) -> int:
        return self.optimizer_moments + self.optimizer_main_params


def static_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int,
                  dp_rank: int | None = None) -> StaticMemory:
    """Weights, gradient buffers and optimizer state of one rank, as Megatron-Core allocates them.

    dp_rank None: the data-parallel rank holding the most optimizer state.
    """
    m, o = cfg.model, cfg.optimizer
    dp_cp = lay.dp * lay.cp
    pbytes = lay.bytes_per_value
    fp8_params = bool(m.fp8) and m.fp8_param_gather and lay.use_te
    params = weights = grads = 0
    fp8 = largest = 0
    opt_per_rank = [0] * dp_cp
    for vp_stage in range(lay.vp):
        chunk = chunk_parameters(cfg, lay, padded_vocab, pp_rank, vp_stage)
        bucket_size = None
        if o.overlap_grad_reduce and vp_stage == 0 and pp_rank == 0:
            bucket_size = max(40_000_000, 1_000_000 * dp_cp)
        # DDP keeps one buffer per parameter dtype: FP8 parameters (uint8) apart from the rest.
        groups = [[p for p in chunk if not (fp8_params and p.linear)], [p for p in chunk if fp8_params and p.linear]]
        for group, elem in zip(groups, (pbytes, 1)):
            if not group:
                continue
            buf = ddp_buffer(group, dp_cp, lay.distributed, bucket_size)
            n = sum(p.numel for p in group)
            params += n
            weights += (buf.numel if lay.distributed else n) * elem
            grads += buf.numel * (4 if o.grad_reduce_in_fp32 else pbytes)  # FP8 params: bf16 grads
            for r, k in enumerate(optimizer_elements(buf, dp_cp, lay.distributed)):
                opt_per_rank[r] += k
            largest = max(largest, max(p.numel for p in group))
        if m.fp8 and lay.use_te:
            linear = sum(p.numel for p in chunk if p.linear)
            fp8 += linear * (1 if fp8_params else 2)  # transposed copy (+ the FP8 copy of bf16 weights)
    opt = max(opt_per_rank) if dp_rank is None else opt_per_rank[dp_rank]
    main = opt * 4 if lay.precision in ("bf16", "fp16") else 0
    return StaticMemory(params=params, weights=weights, gradients=grads, optimizer_moments=opt * 8,
                        optimizer_main_params=main, fp8=fp8, largest_param=largest)


# --------------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------------


def _qkv_saved_units(a: int, g: int, rope: bool, expanded: bool) -> int:
    """Q, K, V kept for attention's backward, in units of s·b·d/t values.

    Local attention expands K and V to all heads (GQA) and keeps the expanded copies. Flash attention
    and the selective-recompute checkpoint keep Q, K and V as given: RoPE makes new Q and K; V is a view
    of the fused QKV output, which therefore stays alive whole (a + 2g).
    """
    if expanded and g < a:
        return 3 * a
    mixed = a + 2 * g
    if rope:
        return a + g + mixed
    return mixed + (a if g < a else 0)  # GQA: reshaping Q out of the grouped layout copies it


def layer_activation_bytes(cfg: Config, lay: Layout, recompute_core_attention: bool = False) -> int:
    """Bytes autograd keeps for one decoder layer and one microbatch (no full recompute).

    Per layer (s = sequence / CP, b = microbatch, t = TP, p = bytes per value, Hs = s·b·h, divided by t
    with sequence parallelism): the two norms' inputs and the two column-parallel GEMMs' inputs (4·Hs·p);
    Q/K/V (`_qkv_saved_units`); the attention output that feeds the output projection (s·b·a·d/t·p); local
    attention's probabilities (fp32 softmax output plus its p-byte copy: (4 + p)·b·a·s²/t, or 4·b·a·s²/t
    in fp32) or flash attention's fp32 log-sum-exp (4·s·b·a/t); the MLP: fc1 output, activation output
    and fc2 input (SwiGLU: 4·s·b·f/t·p; GELU: 2·s·b·f/t·p). With FP8 (TE) the four GEMM inputs are kept as
    1-byte copies instead (the attention output also stays in p bytes for flash attention's backward).
    """
    m = cfg.model
    p = lay.bytes_per_value
    h, a = m.hidden_size, m.num_attention_heads
    g = m.num_query_groups or a
    d = m.kv_channels or h // a
    f = m.ffn_hidden_size or 4 * h
    s, b, t = m.seq_length // lay.cp, lay.mbs, lay.tp
    hs = s * b * h // (t if lay.sp else 1)
    rope = m.position_embedding_type == "rope"
    flash = lay.use_te
    keeps_scores = not flash and not recompute_core_attention
    qkv = _qkv_saved_units(a, g, rope, expanded=keeps_scores) * s * b * d // t * p
    attn_out = s * b * a * d // t * p
    if keeps_scores:
        scores = (4 + (p if p != 4 else 0)) * b * (a // t) * s * s
    elif flash and not recompute_core_attention:
        scores = 4 * s * b * (a // t)
    else:
        scores = 0
    if m.fp8 and lay.use_te:
        # Transformer Engine keeps the GEMM inputs (QKV, fc1, output projection, fc2) as FP8 copies.
        gemm_in = 2 * hs + s * b * a * d // t + s * b * f // t
        mlp = (3 if m.gated_linear_unit else 1) * s * b * f // t * p
        return 2 * hs * p + qkv + attn_out + scores + mlp + gemm_in
    mlp = (4 if m.gated_linear_unit else 2) * s * b * f // t * p
    return 4 * hs * p + qkv + attn_out + scores + mlp


def in_flight(lay: Layout, pp_rank: int) -> dict[int, int]:
    """Microbatches each model chunk of this stage holds activations for at the 1F1B peak."""
    m_total = lay.num_microbatches
    if lay.pp == 1:
        return {0: 1}
    if lay.vp == 1:
        return {0: min(lay.pp - pp_rank, m_total)}
    total = m_total * lay.vp
    warmup = min((lay.pp - pp_rank - 1) * 2 + (lay.vp - 1) * lay.pp, total)
    counts: dict[int, int] = {}
    for k in range(min(warmup + 1, total)):
        chunk = (k // lay.pp) % lay.vp
        counts[chunk] = counts.get(chunk, 0) + 1
    return counts


@dataclass
class ActivationMemory:
    saved: int  # activations held at the peak
    transient: int  # working buffers at the peak
    in_flight: dict[int, int] = field(default_factory=dict)


def activation_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int) -> ActivationMemory:
    """Activations this pipeline stage holds at its peak, and the transient buffers then."""
    m = cfg.model
    p = lay.bytes_per_value
    h = m.hidden_size
    s, b, t = m.seq_length // lay.cp, lay.mbs, lay.tp
    hs = s * b * h // (t if lay.sp else 1)
    per_chunk = m.num_layers // (lay.pp * lay.vp)
    selective = m.recompute_granularity == "selective"
    full_layer = layer_activation_bytes(cfg, lay, recompute_core_attention=selective)
    stored_layers, working = full_layer * per_chunk, 0
    if m.recompute_granularity == "full":
        n = max(1, m.recompute_num_layers or 1)
        if m.recompute_method == "block":
            k = min(n, per_chunk)
            stored_layers = k * hs * p + (per_chunk - k) * full_layer
            working = full_layer if k else 0
        else:
            stored_layers = math.ceil(per_chunk / n) * hs * p
            working = min(n, per_chunk) * full_layer
    vocab_shard = padded_vocab // t
    flights = in_flight(lay, pp_rank)
    saved = 0
    for chunk, count in flights.items():
        per_mb = stored_layers
        if pp_rank == 0 and chunk == 0:
            per_mb += 8 * s * b * (2 if m.position_embedding_type == "learned_absolute" else 1)  # token ids
        if pp_rank == lay.pp - 1 and chunk == lay.vp - 1:
            # final norm input, output-layer input, fp32 softmax kept by the vocab-parallel cross entropy
            per_mb += 2 * hs * p + 4 * s * b * vocab_shard + 9 * s * b
        saved += count * per_mb
    transient = working + 2 * hs * p  # pipeline send/receive (or the stage input/output)
    gather = s * b * h * p if lay.sp else 0  # sequence-parallel all-gather buffer
    if not lay.use_te and selective is False:
        gather = max(gather, b * (m.num_attention_heads // t) * s * s * p)  # shared with the score buffer
    transient += gather
    if pp_rank == lay.pp - 1:
        transient += s * b * vocab_shard * p  # the logits themselves, alive through the loss
    return ActivationMemory(saved=saved, transient=transient, in_flight=flights)


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass
class RankMemory:
    """The memory plan of one rank, in bytes."""

    pp_rank: int
    params: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    fp8: int
    buffers: int
    in_flight: dict[int, int]

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.fp8 + self.buffers

    def gib(self) -> dict[str, float]:
        keys = ("weights", "gradients", "optimizer", "activations", "fp8", "buffers", "total")
        return {k: round(getattr(self, k) / GIB, 3) for k in keys}


def rank_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int, *, fused_adam: bool = True) -> RankMemory:
    """Peak memory of the most loaded data-parallel rank of pipeline stage `pp_rank`.

    The peak is the larger of the backward peak (static + activations + transient buffers) and the
    optimizer step (static + torch Adam's foreach temporaries when there is no fused Adam).
    """
    st = static_memory(cfg, lay, padded_vocab, pp_rank)
    act = activation_memory(cfg, lay, padded_vocab, pp_rank)
    buffers = act.transient + st.largest_param * lay.bytes_per_value  # one weight grad before accumulation
    if not fused_adam:
        buffers = max(buffers, st.optimizer_moments // 2 - act.saved)  # torch foreach Adam: sqrt(v) copy
    return RankMemory(pp_rank=pp_rank, params=st.params, weights=st.weights, gradients=st.gradients,
                      optimizer=st.optimizer, activations=act.saved, fp8=st.fp8, buffers=buffers,
                      in_flight=act.in_flight)


def padded_vocab_for(cfg: Config) -> int:
    """The padded vocabulary (model.vocab_size, else the tokenizer's size)."""
    vocab = cfg.model.vocab_size
    if vocab is None:
        try:
            from pretrain.data import build_tokenizer

            vocab = build_tokenizer(cfg.data).vocab_size
        except Exception as exc:
            raise PlanError(f"cannot size the vocabulary ({exc}); set model.vocab_size") from None
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor  # Megatron's padding rule
    return -(-vocab // multiple) * multiple


def check_layout(cfg: Config, world: int, use_te: bool) -> list[str]:
    """The validator's errors for `cfg` on a GPU cluster of `world` ranks (data need not be configured)."""
    from pretrain.validate import validate

    planning = copy.deepcopy(cfg)
    planning.data.mock = True
    report = validate(planning, world, te_on_gpu=use_te, cuda_available=True, files=False)
    return [str(e) for e in report.errors]


def most_loaded(cfg: Config, lay: Layout, padded_vocab: int, fused_adam: bool = True) -> RankMemory:
    """The rank with the largest planned peak (first and last pipeline stages are the candidates)."""
    stages = sorted({0, lay.pp - 1})
    return max((rank_memory(cfg, lay, padded_vocab, r, fused_adam=fused_adam) for r in stages),
               key=lambda rm: rm.total)


@dataclass
class Cost:
    """Transparent step-time model (seconds per step)."""

    compute_s: float
    bubble_fraction: float
    tp_comm_s: float
    cp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float

    @property
    def step_s(self) -> float:
        return (self.compute_s * (1 + self.bubble_fraction) + self.tp_comm_s + self.cp_comm_s
                + self.pp_comm_s + self.dp_comm_s)


def cost_model(cfg: Config, lay: Layout, padded_vocab: int, gpu: str, gpus_per_node: int,
               params_on_rank: int) -> Cost:
    """Step time = compute/(GEMM efficiency) × (1 + bubble) + TP + CP + PP + DP communication (no overlap).

    - compute: model FLOPs per step / (world × peak × GEMM_EFFICIENCY), ×4/3 with full recompute and
      + the core-attention share with selective recompute;
    - bubble: (P − 1) / (V · M) of the compute;
    - TP: 8 ring collectives per layer per microbatch (4 forward, 4 backward) of (t−1)/t · s·b·h·p bytes,
      over NVLink (TP stays inside a node);
    - CP: ring exchange of K and V, (cp−1) · 2·(s/cp)·b·g·d/t·p bytes per layer per microbatch, ×3 for
      the backward;
    - PP: each microbatch sends activations forward and gradients back once per model chunk;
    - DP: distributed optimizer reduce-scatter (fp32 grads) + all-gather (params), (n−1)/n of the rank's
      parameters each; without it an fp32 all-reduce (2·(n−1)/n). NVLink when the group fits in a node,
      else the network.
    """
    m = cfg.model
    p = lay.bytes_per_value
    fp8 = bool(m.fp8)
    peak = PEAK_TFLOPS[gpu]["fp8" if fp8 else "bf16"] * 1e12
    f_tok = flops_per_token(m, padded_vocab)
    compute = f_tok * lay.gbs * m.seq_length / (lay.world * peak * GEMM_EFFICIENCY)
    h, a = m.hidden_size, m.num_attention_heads
    d = m.kv_channels or h // a
    g = m.num_query_groups or a
    if m.recompute_granularity == "full":
        compute *= 4 / 3
    elif m.recompute_granularity == "selective":
        core = 12 * m.num_layers * h * h * (m.seq_length / (2 * h)) * (a * d / h)
        compute *= 1 + (core / 3) / f_tok
    nv, net = NVLINK_GBPS[gpu] * 1e9, NETWORK_GBPS[gpu] * 1e9
    s, b = m.seq_length // lay.cp, lay.mbs
    mb, layers = lay.num_microbatches, m.num_layers // lay.pp
    recompute_fwd = 1.5 if m.recompute_granularity == "full" else 1.0
    tp = mb * layers * 8 * recompute_fwd * (lay.tp - 1) / lay.tp * s * b * h * p / nv
    cp_bw = nv if lay.tp * lay.cp <= gpus_per_node else net
    cp = mb * layers * 3 * (lay.cp - 1) * 2 * s * b * g * d // lay.tp * p / cp_bw
    hs = s * b * h // (lay.tp if lay.sp else 1)
    pp = 0.0
    if lay.pp > 1:
        pp_bw = net if lay.world > gpus_per_node else nv
        pp = mb * lay.vp * 2 * hs * p / pp_bw
    n = lay.dp * lay.cp
    dp_bw = nv if lay.tp * lay.cp * lay.dp <= gpus_per_node else net
    if lay.distributed:
        dp = (n - 1) / n * params_on_rank * (4 + p) / dp_bw
    else:
        dp = 2 * (n - 1) / n * params_on_rank * 4 / dp_bw
    bubble = (lay.pp - 1) / (lay.vp * mb) if lay.pp > 1 else 0.0
    return Cost(compute, bubble, tp, cp, pp, dp)


def make_plan(cfg: Config, nodes: int, gpus_per_node: int, gpu: str = "h100", mfu: float = DEFAULT_MFU,
              fused_adam: bool = True, name: str | None = None) -> dict[str, Any]:
    """The plan of `cfg` on nodes × gpus_per_node GPUs, as one JSON-ready dict."""
    if gpu not in PEAK_TFLOPS:
        raise PlanError(f"unknown --gpu '{gpu}' (known: {', '.join(PEAK_TFLOPS)})")
    world = nodes * gpus_per_node
    use_te = cfg.model.transformer_impl != "local"
    errors = check_layout(cfg, world, use_te)
    if errors:
        raise PlanError(f"layout does not pass validation on {world} GPUs: " + " | ".join(errors))
    lay = layout_of(cfg, world, on_gpu=True, use_te=use_te)
    vocab = padded_vocab_for(cfg)
    m = cfg.model
    rm = most_loaded(cfg, lay, vocab, fused_adam)
    stages = [rank_memory(cfg, lay, vocab, r, fused_adam=fused_adam) for r in sorted({0, lay.pp - 1})]
    f_tok = flops_per_token(m, vocab)
    f_step = f_tok * lay.gbs * m.seq_length
    peak = PEAK_TFLOPS[gpu]["fp8" if m.fp8 else "bf16"]
    tok_gpu = peak * 1e12 * mfu / f_tok
    cost = cost_model(cfg, lay, vocab, gpu, gpus_per_node, rm.params)
    capacity = GPU_MEMORY_GIB[gpu]
    return {
        "config": name or m.preset or m.family,
        "gpu": gpu,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "world_size": world,
        "layout": {"tensor": lay.tp, "pipeline": lay.pp, "virtual_pipeline": lay.vp if lay.vp > 1 else None,
                   "context": lay.cp, "data": lay.dp, "sequence_parallel": lay.sp,
                   "micro_batch_size": lay.mbs, "global_batch_size": lay.gbs,
                   "num_microbatches": lay.num_microbatches, "distributed_optimizer": lay.distributed,
                   "recompute": m.recompute_granularity, "precision": lay.precision, "fp8": m.fp8,
                   "transformer_engine": use_te},
        "num_parameters": count_parameters(cfg, vocab),
        "padded_vocab_size": vocab,
        "flops_per_token": f_tok,
        "flops_per_step": f_step,
        "flops_formula": FORMULA,
        "memory_gib": rm.gib(),
        "most_loaded_rank": {"pipeline_stage": rm.pp_rank, "parameters": rm.params,
                             "microbatches_in_flight": sum(rm.in_flight.values())},
        "stages": [{"pipeline_stage": s.pp_rank, **s.gib()} for s in stages],
        "gpu_memory_gib": capacity,
        "fits": rm.total / GIB <= HEADROOM * capacity,
        "throughput": {"mfu": mfu, "peak_tflops": peak, "tflops_per_gpu": peak * mfu,
                       "tokens_per_s_per_gpu": tok_gpu,
                       "step_time_s": lay.gbs * m.seq_length / (tok_gpu * world)},
        "cost_model": {**asdict(cost), "step_s": cost.step_s,
                       "tokens_per_s_per_gpu": lay.gbs * m.seq_length / (cost.step_s * world),
                       "mfu": f_step / (cost.step_s * world * peak * 1e12)},
    }


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as text for people."""
    lay, mem, thr, cm = plan["layout"], plan["memory_gib"], plan["throughput"], plan["cost_model"]
    vp = f" VP{lay['virtual_pipeline']}" if lay["virtual_pipeline"] else ""
    lines = [
        f"plan: {plan['config']} on {plan['nodes']} node(s) × {plan['gpus_per_node']} {plan['gpu'].upper()} "
        f"= {plan['world_size']} GPUs",
        f"  layout     TP{lay['tensor']} PP{lay['pipeline']}{vp} CP{lay['context']} DP{lay['data']}"
        f"{' SP' if lay['sequence_parallel'] else ''}; micro batch {lay['micro_batch_size']}, global batch "
        f"{lay['global_batch_size']} ({lay['num_microbatches']} microbatches); {lay['precision']}"
        f"{' + FP8 ' + lay['fp8'] if lay['fp8'] else ''}; recompute {lay['recompute'] or 'none'}; "
        f"{'distributed' if lay['distributed_optimizer'] else 'replicated'} optimizer; "
        f"{'Transformer Engine' if lay['transformer_engine'] else 'local'} spec",
        f"  model      {plan['num_parameters']:,} parameters (padded vocabulary {plan['padded_vocab_size']:,})",
        f"  FLOPs      {plan['flops_per_token']:.4g} per token, {plan['flops_per_step']:.4g} per step",
        f"             {plan['flops_formula']}",
        f"  memory per GPU (GiB), most loaded rank = pipeline stage {plan['most_loaded_rank']['pipeline_stage']} "
        f"({plan['most_loaded_rank']['parameters']:,} parameters, "
        f"{plan['most_loaded_rank']['microbatches_in_flight']} microbatch-chunks in flight):",
    ]
    header = ("stage", "weights", "gradients", "optimizer", "activations", "fp8", "buffers", "total")
    lines.append("    " + "".join(f"{h:>12}" for h in header))
    for st in plan["stages"]:
        lines.append("    " + f"{st['pipeline_stage']:>12}" + "".join(f"{st[k]:>12.2f}" for k in header[1:]))
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    lines.append(f"    peak {mem['total']:.2f} GiB of {plan['gpu_memory_gib']} GiB: {verdict} "
                 f"(keeping {100 - HEADROOM * 100:.0f}% headroom)")
    lines.append(f"  at MFU {thr['mfu']:.0%} of {thr['peak_tflops']:.0f} TFLOP/s: "
                 f"{thr['tflops_per_gpu']:.0f} TFLOP/s/GPU, {thr['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                 f"step {thr['step_time_s']:.2f} s")
    lines.append(f"  cost model: compute {cm['compute_s']:.2f} s × (1 + bubble {cm['bubble_fraction']:.3f}) + TP "
                 f"{cm['tp_comm_s']:.2f} + CP {cm['cp_comm_s']:.2f} + PP {cm['pp_comm_s']:.2f} + DP "
                 f"{cm['dp_comm_s']:.2f} s = {cm['step_s']:.2f} s/step, {cm['tokens_per_s_per_gpu']:,.0f} "
                 f"tokens/s/GPU, MFU {cm['mfu']:.0%}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Search
# --------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(cfg: Config, nodes: int, gpus_per_node: int, gpu: str = "h100", top: int = 5,
           fused_adam: bool = True) -> list[dict[str, Any]]:
    """Every layout that passes the validator and fits in memory, best first by the cost model."""
    if gpu not in PEAK_TFLOPS:
        raise PlanError(f"unknown --gpu '{gpu}' (known: {', '.join(PEAK_TFLOPS)})")
    world = nodes * gpus_per_node
    m = cfg.model
    use_te = m.transformer_impl != "local"
    vocab_cache: dict[int, int] = {}
    results = []
    tps = [t for t in _divisors(gpus_per_node) if t <= 8]
    cps = [1, 2, 4, 8] if use_te else [1]
    recomputes: list[tuple[str | None, str | None, int | None]] = [
        (None, None, None), ("selective", None, None), ("full", "uniform", 1)]
    for tp in tps:
        for cp in cps:
            for pp in _divisors(m.num_layers):
                if world % (tp * cp * pp):
                    continue
                vps = [None] + ([v for v in _divisors(m.num_layers // pp) if 2 <= v <= 10] if pp > 1 else [])
                for vp in vps:
                    for mbs in (1, 2, 4):
                        for gran, method, num in recomputes:
                            c = copy.deepcopy(cfg)
                            c.parallel.tensor, c.parallel.pipeline, c.parallel.context = tp, pp, cp
                            c.parallel.virtual_pipeline = vp
                            c.parallel.sequence_parallel = tp > 1
                            c.parallel.tp_comm_overlap = False
                            c.train.micro_batch_size = mbs
                            c.optimizer.distributed = True
                            c.model.recompute_granularity = gran
                            c.model.recompute_method, c.model.recompute_num_layers = method, num
                            if check_layout(c, world, use_te):
                                continue
                            if tp not in vocab_cache:
                                vocab_cache[tp] = padded_vocab_for(c)
                            lay = layout_of(c, world, on_gpu=True, use_te=use_te)
                            rm = most_loaded(c, lay, vocab_cache[tp], fused_adam)
                            if rm.total / GIB > HEADROOM * GPU_MEMORY_GIB[gpu]:
                                continue
                            cost = cost_model(c, lay, vocab_cache[tp], gpu, gpus_per_node, rm.params)
                            results.append({
                                "tensor": tp, "pipeline": pp, "virtual_pipeline": vp, "context": cp,
                                "data": lay.dp, "micro_batch_size": mbs, "sequence_parallel": tp > 1,
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
             f"train.micro_batch_size={c.train.micro_batch_size}", "optimizer.distributed=true"]
    if c.model.recompute_granularity:
        parts.append(f"model.recompute_granularity={c.model.recompute_granularity}")
    if c.model.recompute_granularity == "full":
        parts += [f"model.recompute_method={c.model.recompute_method}",
                  f"model.recompute_num_layers={c.model.recompute_num_layers}"]
    return " ".join(parts)


def format_search(results: list[dict[str, Any]], total: int) -> str:
    header = f"{'#':>3} {'TP':>3} {'PP':>3} {'VP':>3} {'CP':>3} {'DP':>4} {'MBS':>4} {'recompute':>10} " \
             f"{'mem GiB':>8} {'bubble':>7} {'TP s':>6} {'DP s':>6} {'PP s':>6} {'CP s':>6} {'step s':>7} " \
             f"{'tok/s/GPU':>10}"
    lines = [f"{total} layouts pass validation and fit; best {len(results)} by the cost model:", header]
    for i, r in enumerate(results, 1):
        c = r["cost"]
        lines.append(f"{i:>3} {r['tensor']:>3} {r['pipeline']:>3} {r['virtual_pipeline'] or '-':>3} "
                     f"{r['context']:>3} {r['data']:>4} {r['micro_batch_size']:>4} {r['recompute'] or '-':>10} "
                     f"{r['memory_gib']:>8.1f} {r['bubble_fraction']:>7.3f} {c['tp_comm_s']:>6.2f} "
                     f"{c['dp_comm_s']:>6.2f} {c['pp_comm_s']:>6.2f} {c['cp_comm_s']:>6.2f} {r['step_s']:>7.2f} "
                     f"{r['tokens_per_s_per_gpu']:>10,.0f}")
    if results:
        lines.append(f"best: {results[0]['overrides']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pretrain plan", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="YAML config (a path, or a name from pretrain/configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor=2")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h100", choices=sorted(PEAK_TFLOPS))
    p.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="MFU the throughput figures assume")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--search", action="store_true", help="rank every valid layout that fits")
    p.add_argument("--top", type=int, default=5, help="layouts --search prints")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nodes < 1 or args.gpus_per_node < 1:
        print("plan error: --nodes and --gpus-per-node must be at least 1", file=sys.stderr)
        return 2
    if not 0 < args.mfu <= 1:
        print(f"plan error: --mfu {args.mfu} must be in (0, 1]", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        if args.search:
            everything = search(cfg, args.nodes, args.gpus_per_node, args.gpu, top=0)
            best = everything[: args.top]
            if args.json:
                print(json.dumps({"layouts_considered_ok": len(everything), "top": best}, indent=1))
            else:
                print(format_search(best, len(everything)))
            if not everything:
                print(f"plan error: no layout passes validation and fits {args.nodes}×{args.gpus_per_node} "
                      f"{args.gpu.upper()}", file=sys.stderr)
                return 2
            return 0
        plan = make_plan(cfg, args.nodes, args.gpus_per_node, args.gpu, args.mfu, name=str(args.config))
    except (ConfigError, PlanError) as exc:
        print(f"plan error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    return 0
