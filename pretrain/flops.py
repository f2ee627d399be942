"""FLOP accounting shared by the trainer's MFU and the planner (Megatron-LM's formula).

Training FLOPs per step for a dense decoder (forward + backward = 3 × forward, 2 FLOPs per MAC):

    F = 12 · B · s · L · h² · [ (1 + g/a + s/(2h)) · (a·d/h)      attention: QKV/out proj + causal scores
                               + (f/h) · (3/2 if gated else 1)     MLP
                               + V / (2·L·h) ]                     logits

B = global batch (sequences), s = sequence length, L = layers, h = hidden, a = heads, g = query groups,
d = head dim, f = FFN size, V = padded vocabulary. Divide by B·s for FLOPs per token.
"""

from __future__ import annotations

# Dense peak TFLOP/s per GPU (no sparsity), from the vendors' datasheets (SXM parts).
PEAK_TFLOPS = {
    "h100": {"bf16": 989.0, "fp8": 1979.0},
    "h200": {"bf16": 989.0, "fp8": 1979.0},
    "b200": {"bf16": 2250.0, "fp8": 4500.0},
    "a100": {"bf16": 312.0, "fp8": 312.0},  # no FP8 tensor cores: FP8 runs as bf16 at best
}


def flops_per_token(model_cfg, padded_vocab: int) -> float:
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
    logits = padded_vocab / (2 * L * h)
    return 12.0 * L * h * h * (attention + mlp + logits)


def gpu_peak_tflops(device_name: str, fp8: bool) -> float | None:
    """Dense peak for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), None when unknown."""
    name = device_name.lower()
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks["fp8" if fp8 else "bf16"]
    return None
