"""FLOP accounting and GPU peaks, shared by the trainer's MFU, the planner and the benchmarks.

Training FLOPs per step for a dense decoder (Megatron's accounting: every GEMM runs 3 times —
forward, backward data-gradient, backward weight-gradient — at 2 FLOPs per multiply-add; the causal
mask halves the attention-score and attention-value GEMMs; norms, activations and softmax are not
counted):

    F = 12 · B · s · L · h² · [ (1 + g/a + s/(2h)) · (a·d/h)      attention: QKV/out proj + causal scores
                               + (f/h) · (3/2 if gated else 1)     MLP
                               + V / (2·L·h) ]                     logits

B = global batch (sequences), s = sequence length, L = layers, h = hidden, a = heads, g = query groups,
d = head dim, f = FFN size, V = padded vocabulary. Divide by B·s for FLOPs per token. This is the
formula of Megatron-LM's `num_floating_point_operations` (with its causal halving) for dense models.
Activation recomputation is not counted: MFU measures useful model FLOPs. Sliding-window attention
(`model.sliding_window` W < s) replaces s/2 by the keys a query sees, W − W(W − 1)/(2s) − 1/2 on windowed
layers, averaged over the layers (`model_providers.core.windows.mean_attended_keys`): the s×W term instead of s²/2.

MoE (`model.num_moe_experts`): FLOPs follow the *active* parameters. The MLP term becomes
`k · (f_e/h) · (3/2 if gated else 1)` (each token runs its top-k experts of size f_e = moe_ffn_hidden_size)
plus the router GEMM `E/(2h)` (h → E logits per token) and the shared experts `(f_s/h) · (3/2 if gated else 1)`;
nominal, i.e. dropless (a capacity factor that drops tokens does fewer). Dense-first models (`moe_layer_freq`) sum
dense and MoE layers.

Multi-Latent Attention (`model.multi_latent_attention`): the attention term is its projections, P/(2h²) with
P = h·r_q + r_q·a·(d_qk + d_pe) (or h·a·(d_qk + d_pe) without q LoRA) + h·(r_kv + d_pe) + r_kv·a·(d_qk + d_v) +
a·d_v·h, plus the causal scores s·a·(d_qk + d_pe + d_v)/(4h²). Multi-Token Prediction adds, per MTP layer, a
transformer layer like the last, its input projection (2h → h: 1) and another output GEMM (V/(2h)), as
Megatron-LM counts them (they run every step).

Gated DeltaNet (`model.experimental_attention_variant=gated_delta_net`, Qwen3-Next): on its layers
(`model.linear_attention_freq`) the attention term is Megatron-LM's for the layer, [h·(2qk + 2v + 2n_v) (in_proj) +
w·(2qk + v) (conv) + 4·n_v·d_v² (the delta rule's KKᵀ, VKᵀ, state update, Sq) + h·v (out_proj)] / (2h²), with
qk = n_k·d_k, v = n_v·d_v, w the conv width; the output gate of gated attention (`model.attention_output_gate`)
adds its projection, (a·d/h)/2. The layers are averaged; an MTP layer is like the last.

Hybrid Mamba models (`model.hybrid_layer_pattern`): Megatron-LM's hybrid accounting, per layer kind
(`model_providers.core.hybrid.flops_per_token`).
"""

from __future__ import annotations

from typing import Any

from model_providers.core import hybrid
from model_providers.core.windows import mean_attended_keys

# Dense peak TFLOP/s per GPU (no sparsity), from the vendors' datasheets (SXM parts; GB200/GB300: one GPU of an NVL72
# rack, whose datasheet gives the rack's figures with sparsity: 72 GPUs, halved). The one table of peaks: the
# trainer's MFU, the planner and the benchmarks all read it. MXFP8 runs at the FP8 rate, NVFP4 at the FP4 rate
# (Blackwell only: a GPU without the key has no such tensor cores). Sources, per GPU: DGX B200 datasheet (36 / 72 /
# 144 PFLOPS BF16 / FP8 / FP4 for 8 GPUs, sparse); HGX B300 (36 / 72 / 108 dense FP4); GB200 NVL72 (360 / 720 / 1,440
# sparse for 72); GB300 NVL72 (360 / 720 sparse, 1,080 dense FP4 for 72).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h100": {"bf16": 989.0, "fp8": 1979.0},
    "h200": {"bf16": 989.0, "fp8": 1979.0},
    "b200": {"bf16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0, "nvfp4": 9000.0},
    "b300": {"bf16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0, "nvfp4": 13500.0},
    "gb200": {"bf16": 2500.0, "fp8": 5000.0, "mxfp8": 5000.0, "nvfp4": 10000.0},
    "gb300": {"bf16": 2500.0, "fp8": 5000.0, "mxfp8": 5000.0, "nvfp4": 15000.0},
    "a100": {"bf16": 312.0, "fp8": 312.0},  # no FP8 tensor cores: FP8 runs as bf16 at best
}


def _mla_attention(m: Any) -> float:
    """MLA's attention term (projections and causal scores), in units of 12·h² FLOPs per token."""
    h, a, s = m.hidden_size, m.num_attention_heads, m.seq_length
    qk, pe, v = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
    q = h * a * (qk + pe) if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank * a * (qk + pe)
    projections = q + h * (m.kv_lora_rank + pe) + m.kv_lora_rank * a * (qk + v) + a * v * h
    return projections / (2 * h * h) + s * a * (qk + pe + v) / (4 * h * h)


def _linear_attention(m: Any, attention: float) -> tuple[float, float]:
    """(the attention term averaged over the layers, the last layer's) with Gated DeltaNet layers and the output gate;
    (attention, attention) for a model with neither."""
    from model_providers.core.linear_layers import has_linear_attention, linear_pattern

    h = m.hidden_size
    if getattr(m, "attention_output_gate", False):
        attention += 0.5 * m.num_attention_heads * (m.kv_channels or h // m.num_attention_heads) / h
    if not has_linear_attention(m):
        return attention, attention
    qk, nv, dv = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads, m.linear_value_head_dim
    v = nv * dv
    gdn = (h * (2 * qk + 2 * v + 2 * nv) + m.linear_conv_kernel_dim * (2 * qk + v) + 4 * nv * dv * dv + h * v) \
        / (2 * h * h)
    pattern = linear_pattern(m.num_layers, m.linear_attention_freq)
    mean = (sum(pattern) * gdn + (len(pattern) - sum(pattern)) * attention) / len(pattern)
    return mean, (gdn if pattern[-1] else attention)


def _moe_pattern(m: Any) -> list[bool]:
    freq = getattr(m, "moe_layer_freq", 1)
    if isinstance(freq, list):
        return [bool(x) for x in freq]
    return [i % freq == 0 for i in range(m.num_layers)]


def flops_per_token(model_cfg: Any, padded_vocab: int) -> float:
    """Training FLOPs per token (forward + backward) for the config's model."""
    m = model_cfg
    if hybrid.is_hybrid(m):  # Megatron's hybrid-model accounting (model_providers/core/hybrid.py)
        return hybrid.flops_per_token(m, padded_vocab)
    h, L = m.hidden_size, m.num_layers
    a = m.num_attention_heads
    g = m.num_query_groups or a
    d = m.kv_channels or h // a
    f = m.ffn_hidden_size or 4 * h
    gated = 1.5 if m.gated_linear_unit else 1.0
    if getattr(m, "multi_latent_attention", False):
        attention = _mla_attention(m)
    else:
        attention = (1 + g / a + mean_attended_keys(m) / h) * (a * d / h)  # s/(2h) without a window
    attention, last_attention = _linear_attention(m, attention)
    mlp = (f / h) * gated
    logits = padded_vocab / (2 * L * h)
    mtp = getattr(m, "mtp_num_layers", None) or 0
    if not getattr(m, "num_moe_experts", None) and not mtp:
        return 12.0 * L * h * h * (attention + mlp + logits)
    last = mlp
    if getattr(m, "num_moe_experts", None):
        moe = m.moe_router_topk * ((m.moe_ffn_hidden_size or f) / h) * gated + m.num_moe_experts / (2 * h)
        moe += (getattr(m, "moe_shared_expert_intermediate_size", None) or 0) / h * gated
        pattern = _moe_pattern(m)
        n_moe = sum(pattern)
        mlp, last = ((L - n_moe) * mlp + n_moe * moe) / L, (moe if pattern[-1] else mlp)  # MTP: like the last
    per_layer = attention + mlp + logits
    return 12.0 * h * h * (L * per_layer + mtp * (last_attention + last + 1 + padded_vocab / (2 * h)))


def flops_per_step(model_cfg: Any, padded_vocab: int, global_batch_size: int) -> float:
    """Training FLOPs of one optimizer step (global batch × sequence length tokens)."""
    return flops_per_token(model_cfg, padded_vocab) * global_batch_size * model_cfg.seq_length


def gpu_key(device_name: str) -> str | None:
    """'h100' for 'NVIDIA H100 80GB HBM3' (a key of PEAK_TFLOPS), None when unknown; the longest key that matches
    ('NVIDIA GB200' is a gb200, not a b200)."""
    name = device_name.lower()
    found = [key for key in PEAK_TFLOPS if key in name]
    return max(found, key=len) if found else None


def gpu_peak_tflops(device_name: str, fp8: bool) -> float | None:
    """Dense peak for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), None when unknown."""
    key = gpu_key(device_name)
    if key is None:
        return None
    return PEAK_TFLOPS[key]["fp8" if fp8 else "bf16"]
