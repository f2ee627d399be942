"""Rules of hybrid Mamba models (`model.hybrid_layer_pattern`: Megatron-Core's `MambaModel`, docs/hybrid.md).

- the pattern: Megatron-Core's symbols only (M, *, -, E), one per layer; MoE layers need experts and experts need
  MoE layers;
- the Mamba-2 mixer's split (Megatron-Core asserts each): heads and groups divide by TP, heads by groups; under CP
  (its all-to-all) each TP rank's heads divide by CP, and its groups divide by CP or CP by them;
- what the CUDA kernels take (a config must also run on GPUs): a power-of-2 SSD chunk (mamba_ssm's Triton scan)
  and a convolution of a multiple of 8 channels per rank (the channel-last layout `mamba_split_conv1d_scan_combined`
  passes it); the convolution's widths 2-4 are the range `model.mamba_conv_kernel` declares;
- the initial time steps' interval: mamba_dt_min <= mamba_dt_max;
- Multi-Token Prediction (0.19+): `model.mtp_num_layers` depths of `model.mtp_layer_pattern` (the decoder's symbols;
  E needs experts), both or neither;
- what the release does not build: virtual pipeline stages, layout strings and the embedding / loss in the split
  (0.16.1-0.18 split the stages inside the stack, evenly or by first/last stage; 0.19+ take `|` boundaries, which
  the builder writes from our placement), MTP (0.16.1-0.18: none);
- what the hybrid model does not wire: full recompute (the Mamba stack has none), Megatron-FSDP (our fsdp_dtensor
  key mapping is GPTModel's), and the GPT-only attention options (MLA, windows, sinks, YaRN, Llama-3 RoPE scaling,
  Gated DeltaNet layers, the output gate, zero-centred norms).
"""

from __future__ import annotations

from model_providers.core import hybrid
from pretrain.config import ModelConfig, OptimizerConfig, ParallelConfig
from pretrain.layout import Layout
from pretrain.problems import Report

_KEY = "model.hybrid_layer_pattern"


def hybrid_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig, optimizer: OptimizerConfig,
                 lay: Layout | None, te_on_gpu: bool) -> None:
    """Every rule of a hybrid model (module docstring); nothing for a GPT."""
    m = model
    _latent_moe_rules(r, m, lay, te_on_gpu)
    if not hybrid.is_hybrid(m):
        if m.mtp_layer_pattern is not None:
            r.error("model.mtp_layer_pattern", "model.mtp_layer_pattern gives a hybrid model's MTP layers; this model "
                    "has no model.hybrid_layer_pattern (a GPT's MTP layer is its last decoder layer's kind)",
                    "set model.mtp_layer_pattern=null")
        if m.position_embedding_type == "none":
            r.error("model.position_embedding_type", "model.position_embedding_type=none is for hybrid Mamba models "
                    "(order comes from their Mamba layers); a GPT needs a position encoding",
                    "set model.position_embedding_type=rope (or set model.hybrid_layer_pattern)")
        return
    problem = hybrid.pattern_problem(m.hybrid_layer_pattern, m.num_layers)
    counts = hybrid.counts(m)
    if problem:
        r.error((_KEY, "model.num_layers"), f"{_KEY}={m.hybrid_layer_pattern!r} {problem}",
                "give one of M, *, -, E per layer")
    elif counts[hybrid.MOE] and not m.num_moe_experts:
        r.error((_KEY, "model.num_moe_experts"), f"{_KEY} has {counts[hybrid.MOE]} MoE layer(s) (E) but "
                "model.num_moe_experts is null", "set model.num_moe_experts or use - (MLP) layers")
    elif m.num_moe_experts and not counts[hybrid.MOE]:
        r.error((_KEY, "model.num_moe_experts"), f"model.num_moe_experts={m.num_moe_experts} but {_KEY} has no MoE "
                "layer (E): the experts would not exist", "set model.num_moe_experts=null or add E layers")
    mtp_problem = _mtp_rules(r, m)
    if counts[hybrid.MAMBA] or hybrid.MAMBA in hybrid.mtp_pattern(m) or problem or mtp_problem:
        _mixer_rules(r, m, parallel)
    _unwired_rules(r, m, parallel, optimizer)


def _mtp_rules(r: Report, m: ModelConfig) -> bool:
    """A hybrid model's Multi-Token Prediction (Megatron-Core 0.19+): `model.mtp_num_layers` depths of
    `model.mtp_layer_pattern`'s layers, the symbols of the decoder's. True where the MTP pattern is refused."""
    from pretrain.compat import hybrid as compat

    depths, pattern = m.mtp_num_layers, m.mtp_layer_pattern
    if compat.MTP_REASON is not None:
        if depths or pattern is not None:
            r.error((_KEY, "model.mtp_num_layers"), f"Multi-Token Prediction in a hybrid model: {compat.MTP_REASON}",
                    "set model.mtp_num_layers=null and model.mtp_layer_pattern=null")
        return False
    if depths is None or depths < 1:  # below 1: the range rule's
        if pattern is not None and depths is None:
            r.error(("model.mtp_layer_pattern", "model.mtp_num_layers"), f"model.mtp_layer_pattern={pattern!r} "
                    "gives the layers of one MTP depth, but model.mtp_num_layers (the depths) is null",
                    "set model.mtp_num_layers (e.g. 2, Nemotron 3 Super's) or model.mtp_layer_pattern=null")
        return False
    if pattern is None:
        r.error(("model.mtp_num_layers", "model.mtp_layer_pattern"), f"model.mtp_num_layers={depths} in a hybrid "
                "model needs the layers of each MTP depth: model.mtp_layer_pattern is null",
                "set model.mtp_layer_pattern (e.g. '*E', Nemotron 3 Super's: attention, then MoE)")
        return True
    unknown = sorted({c for c in pattern if c not in hybrid.SYMBOLS})
    if unknown or not pattern:
        r.error("model.mtp_layer_pattern", f"model.mtp_layer_pattern={pattern!r} "
                + (f"has the unknown symbol(s) {' '.join(map(repr, unknown))}" if unknown else "is empty"),
                "give one of M, *, -, E per layer of an MTP depth (e.g. '*E')")
        return True
    if hybrid.MOE in pattern and not m.num_moe_experts:
        r.error(("model.mtp_layer_pattern", "model.num_moe_experts"), f"model.mtp_layer_pattern={pattern!r} has "
                "MoE layer(s) (E) but model.num_moe_experts is null", "use - (MLP) layers, or set experts")
        return True
    return False


def _mixer_rules(r: Report, m: ModelConfig, p: ParallelConfig) -> None:
    """The Mamba-2 mixer's split over TP and CP, and the CUDA kernels' limits."""
    tp, cp = max(p.tensor, 1), max(p.context, 1)
    sizes = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_chunk_size", "mamba_conv_kernel")
    if any(getattr(m, key) < 1 for key in sizes) or (m.mamba_num_heads is not None and m.mamba_num_heads < 1):
        return  # the range rule reported it (`knob(range=...)`, pretrain/rules/bounds.py)
    if m.mamba_num_heads is None and (2 * m.hidden_size) % m.mamba_head_dim:
        r.error(("model.mamba_num_heads", "model.mamba_head_dim"), f"model.mamba_num_heads=null means 2 × "
                f"hidden_size / mamba_head_dim = {2 * m.hidden_size} / {m.mamba_head_dim}, not a whole number",
                "set model.mamba_num_heads")
        return
    heads, groups = hybrid.mamba_num_heads(m), m.mamba_num_groups
    if heads < 1:
        r.error("model.mamba_num_heads", f"model.mamba_num_heads=null means 2 × hidden_size / mamba_head_dim = "
                f"{heads}: no Mamba head", "set model.mamba_num_heads")
        return
    if heads % groups:
        r.error(("model.mamba_num_heads", "model.mamba_num_groups"), f"{heads} Mamba heads do not split into "
                f"model.mamba_num_groups={groups} groups", "make the heads a multiple of the groups")
    if heads % tp or groups % tp:
        r.error(("model.mamba_num_heads", "model.mamba_num_groups", "parallel.tensor"),
                f"{heads} Mamba heads and {groups} groups must both divide by parallel.tensor={tp} (each TP rank "
                "holds whole heads and groups)", "choose a tensor-parallel size dividing both")
    elif cp > 1 and ((heads // tp) % cp or ((groups // tp) % cp and cp % (groups // tp))):
        r.error(("model.mamba_num_heads", "model.mamba_num_groups", "parallel.context"),
                f"Mamba's context parallelism gives each CP rank heads/(TP·CP) heads and a share of the groups: "
                f"{heads // tp} heads and {groups // tp} groups per TP rank do not split over parallel.context={cp}",
                "choose a context-parallel size dividing the heads per TP rank (and the groups, or divided by them)")
    if m.mamba_dt_min > m.mamba_dt_max:
        r.error(("model.mamba_dt_min", "model.mamba_dt_max"), f"model.mamba_dt_min={m.mamba_dt_min} is above "
                f"model.mamba_dt_max={m.mamba_dt_max}: the initial time steps are drawn between them",
                "set model.mamba_dt_min <= model.mamba_dt_max")
    if m.mamba_chunk_size & (m.mamba_chunk_size - 1):
        r.error("model.mamba_chunk_size", f"model.mamba_chunk_size={m.mamba_chunk_size}: mamba_ssm's SSD scan "
                "kernels take a power of 2", "set e.g. model.mamba_chunk_size=128")
    if not (heads % tp or groups % tp or (heads // tp) % cp):
        channels = heads // (tp * cp) * m.mamba_head_dim + 2 * max(groups // (tp * cp), 1) * m.mamba_state_dim
        if channels % 8:
            r.error(("model.mamba_head_dim", "model.mamba_state_dim", "model.mamba_num_groups"),
                    f"the Mamba convolution has {channels} channels per rank (x, B, C); the causal_conv1d CUDA kernel "
                    "takes the channel-last layout only for a multiple of 8", "make head_dim × heads per rank and "
                    "state × groups per rank multiples of 8")


def _unwired_rules(r: Report, m: ModelConfig, p: ParallelConfig, o: OptimizerConfig) -> None:
    """Settings the hybrid model does not run as asked (module docstring)."""
    from pretrain.compat import hybrid as compat

    fix_layout = "leave it unset (Megatron-Core splits the pattern's layers evenly, or by first/last stage layers)"
    if p.virtual_pipeline and compat.VP_REASON is not None:
        r.error((_KEY, "parallel.virtual_pipeline"), f"a hybrid model's virtual pipeline: {compat.VP_REASON}",
                "set parallel.virtual_pipeline=null")
    for key in ("pipeline_layout", "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if getattr(p, key) and compat.LAYOUT_REASON is not None:
            r.error((_KEY, f"parallel.{key}"), f"parallel.{key} places GPT decoder layers; {compat.LAYOUT_REASON}",
                    fix_layout)
    if m.recompute_granularity == "full":
        r.error((_KEY, "model.recompute_granularity"), "full recompute: Megatron-Core's Mamba stack has no recompute "
                "of whole layers (it would be ignored)", "use model.recompute_granularity=selective")
    if o.fsdp or o.fsdp_sharding:
        r.error((_KEY, "optimizer.fsdp"), "Megatron-FSDP with a hybrid model: the fsdp_dtensor checkpoint mapping "
                "(pretrain/checkpoint/fsdp_format.py) knows GPTModel's layers only",
                "use optimizer.distributed=true (ZeRO-1)")
    for key, bad, why in (("multi_latent_attention", m.multi_latent_attention, "Multi-Latent Attention"),
                          ("sliding_window", m.sliding_window is not None, "sliding-window attention"),
                          ("softmax_type", m.softmax_type != "vanilla", "attention sinks"),
                          ("rope_scaling", m.rope_scaling, "Llama-3 RoPE scaling"),
                          ("position_embedding_type", m.position_embedding_type not in ("none", "rope"),
                           f"position_embedding_type={m.position_embedding_type} (MambaModel: none or rope)"),
                          ("moe_layer_freq", m.moe_layer_freq != 1, "moe_layer_freq (the pattern places MoE layers)"),
                          ("experimental_attention_variant", m.experimental_attention_variant is not None,
                           "Gated DeltaNet layers (a GPTModel's linear attention; the pattern places Mamba layers)"),
                          ("attention_output_gate", m.attention_output_gate, "the attention output gate"),
                          ("layernorm_zero_centered_gamma", m.layernorm_zero_centered_gamma,
                           "zero-centred norms (the Mamba mixer's gated norm and its initial values are not)")):
        if bad:
            r.error((_KEY, f"model.{key}"), f"{why} is not wired into the hybrid model here",
                    f"leave model.{key} at its default")


def _latent_moe_rules(r: Report, m: ModelConfig, lay: Layout | None, te_on_gpu: bool) -> None:
    """LatentMoE (`model.moe_latent_size`, Nemotron 3 Super): Megatron-Core builds its projections with Transformer
    Engine only (`TELinear`; it asserts it), and the experts need a router to reach them."""
    from pretrain.layout import use_transformer_engine

    if m.moe_latent_size is None:
        return
    if not m.num_moe_experts:  # its width: the range rule's
        r.error(("model.moe_latent_size", "model.num_moe_experts"), f"model.moe_latent_size={m.moe_latent_size} "
                "needs experts", "set model.moe_latent_size=null or model.num_moe_experts")
    use_te = lay.use_te if lay is not None else use_transformer_engine(m.transformer_impl, te_on_gpu)
    if not use_te:
        r.error(("model.moe_latent_size", "model.transformer_impl"), "LatentMoE (model.moe_latent_size): Megatron-Core "
                "builds its latent projections with Transformer Engine only (TELinear; it asserts it)",
                "run on GPUs with Transformer Engine, or set model.moe_latent_size=null")
