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
Activation recomputation is not counted: MFU measures useful model FLOPs.

MoE (`model.num_moe_experts`): FLOPs follow the *active* parameters. The MLP term becomes
`k · (f_e/h) · (3/2 if gated else 1)` (each token runs its top-k experts of size f_e = moe_ffn_hidden_size)
plus the router GEMM `E/(2h)` (h → E logits per token); nominal, i.e. dropless (a capacity factor that drops
tokens does fewer).
"""

from __future__ import annotations

from typing import Any

# Dense peak TFLOP/s per GPU (no sparsity), from the vendors' datasheets (SXM parts). The one table of
# peaks: the trainer's MFU, the planner and the benchmarks all read it.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h100": {"bf16": 989.0, "fp8": 1979.0},
    "h200": {"bf16": 989.0, "fp8": 1979.0},
    "b200": {"bf16": 2250.0, "fp8": 4500.0},
    "a100": {"bf16": 312.0, "fp8": 312.0},  # no FP8 tensor cores: FP8 runs as bf16 at best
}


def flops_per_token(model_cfg: Any, padded_vocab: int) -> float:
    """Training FLOPs per token (forward + backward) for the config's model."""
    m = model_cfg
    h, L, s = m.hidden_size, m.num_layers, m.seq_length
    a = m.num_attention_heads
    g = m.num_query_groups or a
    d = m.kv_channels or h // a
    f = m.ffn_hidden_size or 4 * h
    gated = 1.5 if m.gated_linear_unit else 1.0
    attention = (1 + g / a + s / (2 * h)) * (a * d / h)
    mlp = (f / h) * gated
    if getattr(m, "num_moe_experts", None):
        mlp = m.moe_router_topk * ((m.moe_ffn_hidden_size or f) / h) * gated + m.num_moe_experts / (2 * h)
    logits = padded_vocab / (2 * L * h)
    return 12.0 * L * h * h * (attention + mlp + logits)


def flops_per_step(model_cfg: Any, padded_vocab: int, global_batch_size: int) -> float:
    """Training FLOPs of one optimizer step (global batch × sequence length tokens)."""
    return flops_per_token(model_cfg, padded_vocab) * global_batch_size * model_cfg.seq_length


def gpu_key(device_name: str) -> str | None:
    """'h100' for 'NVIDIA H100 80GB HBM3' (a key of PEAK_TFLOPS), None when unknown."""
    name = device_name.lower()
    for key in PEAK_TFLOPS:
        if key in name:
            return key
    return None


def gpu_peak_tflops(device_name: str, fp8: bool) -> float | None:
    """Dense peak for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), None when unknown."""
    key = gpu_key(device_name)
    if key is None:
        return None
    return PEAK_TFLOPS[key]["fp8" if fp8 else "bf16"]
