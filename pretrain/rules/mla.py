"""DeepSeek-V3-class rules: Multi-Latent Attention, DeepSeek routing (groups, expert bias, scaling), shared experts,
dense-first layers and Multi-Token Prediction — the combinations Megatron-Core would assert on later (its
`TransformerConfig.__post_init__`, the layer specs, `MultiLatentAttention` and the MTP block of 0.16.1 – 0.19.2),
refused here with one line each."""

from __future__ import annotations

from pretrain.config import DataConfig, ModelConfig, ParallelConfig
from pretrain.layout import Layout, use_transformer_engine
from pretrain.problems import Report


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def mla_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig, data: DataConfig, lay: Layout | None,
              te_on_gpu: bool) -> None:
    """Multi-Latent Attention: shapes, TP splits, RoPE."""
    m, p = model, parallel
    if not m.multi_latent_attention:
        return
    tp = p.tensor
    if m.qk_pos_emb_head_dim % 2:
        r.error("model.qk_pos_emb_head_dim", f"model.qk_pos_emb_head_dim={m.qk_pos_emb_head_dim} must be even "
                "(RoPE rotates pairs)", "use an even RoPE width, e.g. 64")
    use_te = lay.use_te if lay is not None else use_transformer_engine(m.transformer_impl, te_on_gpu)
    if not use_te and tp > 1:  # the local spec's down-projections are column-parallel (TE duplicates them)
        widths = {"model.kv_lora_rank + model.qk_pos_emb_head_dim": m.kv_lora_rank + m.qk_pos_emb_head_dim}
        if m.q_lora_rank is not None:
            widths["model.q_lora_rank"] = m.q_lora_rank
        for key, width in widths.items():
            if width % tp:
                keys = tuple(k.strip() for k in key.split("+")) + ("parallel.tensor",)
                r.error(keys, f"{key} = {width} is not divisible by parallel.tensor={tp} (the local spec splits "
                        "MLA's down-projections over TP)", f"choose parallel.tensor from {_divisors(width)}")
    if not use_te and (p.context > 1 or data.reset_attention_mask):
        keys = ("model.multi_latent_attention",) + (("parallel.context",) if p.context > 1 else ()) \
            + (("data.reset_attention_mask",) if data.reset_attention_mask else ())
        r.error(keys, "Multi-Latent Attention with context parallelism or packed documents needs Transformer "
                "Engine: the local spec's context-parallel attention is checked for standard attention only",
                "set parallel.context=1 and data.reset_attention_mask=false on CPU, or run MLA with TE on GPUs")
    if m.position_embedding_type != "rope":
        r.error(("model.multi_latent_attention", "model.position_embedding_type"),
                "Multi-Latent Attention applies its own RoPE (model.rope_type); model.position_embedding_type="
                f"{m.position_embedding_type} would add a second position encoding",
                "set model.position_embedding_type=rope")
    if m.sliding_window is not None:
        r.error(("model.multi_latent_attention", "model.sliding_window"),
                "Multi-Latent Attention has no sliding-window attention in Megatron-Core",
                "set model.sliding_window=null")
    if m.rope_scaling:
        r.error(("model.multi_latent_attention", "model.rope_scaling"),
                "model.rope_scaling (Llama-3 RoPE scaling) does not apply to MLA, whose RoPE is model.rope_type",
                "set model.rope_scaling=false and model.rope_type=yarn for a scaled context")
    if m.rope_type != "yarn" and m.rotary_scaling_factor != 1.0 and m.mscale_all_dim:
        r.error(("model.rotary_scaling_factor", "model.mscale_all_dim", "model.rope_type"),
                f"model.rotary_scaling_factor={m.rotary_scaling_factor} with model.mscale_all_dim={m.mscale_all_dim} "
                "scales MLA's softmax even with model.rope_type=rope (Megatron-Core), which plain RoPE does not",
                "set model.rope_type=yarn, or model.rotary_scaling_factor=1")
    if not m.qk_layernorm:
        r.notes.append("model.qk_layernorm=false: MLA without its latent norms (DeepSeek-V3 has them; such a model "
                       "cannot be exported to HF)")


def deepseek_moe_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig) -> None:
    """Dense-first layers, shared experts, group-limited routing, the expert bias and its update."""
    m, p = model, parallel
    if m.num_moe_experts is None:  # its MoE keys on a dense model: one rule, rules/parallel.py (moe_rules)
        return
    experts, k = m.num_moe_experts, m.moe_router_topk
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers or any(x not in (0, 1) for x in freq):
            r.error(("model.moe_layer_freq", "model.num_layers"), f"model.moe_layer_freq must list 0 (dense) or 1 "
                    f"(MoE) for each of the model.num_layers={m.num_layers} layers (got {len(freq)} values)",
                    f"e.g. [0, {', '.join(['1'] * min(3, m.num_layers - 1))}{', ...' if m.num_layers > 4 else ''}]")
        elif 1 not in freq:
            r.error("model.moe_layer_freq", "model.moe_layer_freq has no MoE layer (all 0)",
                    "mark MoE layers with 1, or set model.num_moe_experts=null for a dense model")
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None and shared >= 1:  # below 1: the range rule's
        if shared % p.tensor:
            r.error(("model.moe_shared_expert_intermediate_size", "parallel.tensor"),
                    f"model.moe_shared_expert_intermediate_size={shared} is not divisible by parallel.tensor="
                    f"{p.tensor} (shared experts split over TP)", f"choose parallel.tensor from {_divisors(shared)}")
    _group_rules(r, m, experts, k)
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        r.error(("model.moe_router_enable_expert_bias", "model.moe_router_score_function"),
                "the expert bias (aux-loss-free balancing) needs sigmoid scores (Megatron-Core)",
                "set model.moe_router_score_function=sigmoid or model.moe_router_enable_expert_bias=false")


def _group_rules(r: Report, m, experts: int, k: int) -> None:
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        missing = "model.moe_router_num_groups" if groups is None else "model.moe_router_group_topk"
        r.error(("model.moe_router_num_groups", "model.moe_router_group_topk"),
                f"group-limited routing needs both model.moe_router_num_groups and model.moe_router_group_topk "
                f"({missing} is null{'; Megatron-Core would ignore the groups' if group_topk is None else ''})",
                f"set {missing}, or both to null")
        return
    if groups < 1 or group_topk < 1:  # the range rule's
        return
    if experts % groups:
        r.error(("model.moe_router_num_groups", "model.num_moe_experts"),
                f"model.num_moe_experts={experts} is not divisible by model.moe_router_num_groups={groups}",
                f"choose moe_router_num_groups from {_divisors(experts)}")
        return
    if group_topk > groups:
        r.error(("model.moe_router_group_topk", "model.moe_router_num_groups"),
                f"model.moe_router_group_topk={group_topk} is more than model.moe_router_num_groups={groups}",
                f"choose moe_router_group_topk from 1 to {groups}")
        return
    per_group = experts // groups
    if k < group_topk or k // group_topk > per_group or k > group_topk * per_group:
        r.error(("model.moe_router_topk", "model.moe_router_group_topk", "model.moe_router_num_groups"),
                f"model.moe_router_topk={k} cannot be chosen from model.moe_router_group_topk={group_topk} groups of "
                f"{per_group} experts (Megatron-Core ranks groups by their top topk/group_topk = {k // group_topk} "
                "scores, then takes the top k of the chosen groups)",
                f"use moe_router_topk between {group_topk} and {group_topk * per_group}")


def mtp_rules(r: Report, *, model: ModelConfig) -> None:
    """Multi-Token Prediction: depth, recompute, and where Megatron-Core places it."""
    m = model
    if m.mtp_num_layers is None:
        return
    if m.mtp_num_layers < 1:  # the range rule's
        return
    if m.recompute_granularity == "full" and m.recompute_method == "uniform" and (m.recompute_num_layers or 1) != 1:
        r.error(("model.mtp_num_layers", "model.recompute_num_layers"),
                f"full uniform recompute with MTP needs model.recompute_num_layers=1 (Megatron-Core asserts it for the "
                f"MTP layers; got {m.recompute_num_layers})", "set model.recompute_num_layers=1")
    if m.recompute_granularity == "full" and m.recompute_method == "block":
        r.notes.append("model.recompute_method=block: Megatron-Core does not recompute the MTP layers (block recompute "
                       "is not implemented for MTP); they keep their activations")


def blockwise_fp8_rules(r: Report, *, model: ModelConfig, te_on_gpu: bool) -> None:
    """model.fp8=blockwise (DeepSeek-V3's 128-wide block scaling, TE's Float8BlockScaling): Megatron-Core builds it
    only with Transformer Engine >= 2.3 (`fp8_utils.py`) and raises ValueError otherwise; TE itself refuses it on
    devices its `check_fp8_block_scaling_support` rejects (compute capability, CUDA version)."""
    if model.fp8 != "blockwise" or not te_on_gpu:
        return  # without TE on a GPU, precision_rules refuses FP8 already
    from importlib import metadata

    from packaging.version import Version

    try:
        te = Version(metadata.version("transformer-engine"))
    except (metadata.PackageNotFoundError, ValueError):
        return
    if te < Version("2.3.0.dev0"):
        r.error("model.fp8", f"model.fp8=blockwise needs Transformer Engine >= 2.3 (installed {te})",
                "install transformer-engine >= 2.3, or use model.fp8=tensorwise")
        return
    supported, reason = te_block_scaling_support()
    if not supported:
        r.error("model.fp8", f"model.fp8=blockwise is not supported on this GPU (Transformer Engine: {reason})",
                "use another recipe, e.g. model.fp8=tensorwise")


def te_block_scaling_support() -> tuple[bool, str]:
    """Transformer Engine's own check of FP8 block scaling on this device (its module moved across releases)."""
    import importlib

    for module in ("transformer_engine.pytorch.fp8", "transformer_engine.pytorch.quantization"):
        try:
            check = getattr(importlib.import_module(module), "check_fp8_block_scaling_support", None)
        except Exception:  # noqa: BLE001 - a TE build without this module, or one that cannot load here
            continue
        if check is not None:
            return check()
    return True, ""
