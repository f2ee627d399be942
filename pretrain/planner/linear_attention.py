"""The planner's terms of Gated DeltaNet layers (Qwen3-Next, Qwen3.5) and of output-gated attention: parameters per
TP rank, activations and the recurrent state per layer and microbatch. (FLOPs per token: `pretrain.observe.flops`,
the one owner of FLOP accounting, with Megatron-LM's Gated DeltaNet term.)

Which layers: `model.linear_attention_freq` (`model_providers.core.linear_layers.linear_pattern`). Notation as in
`pretrain.planner.activations`: s = sequence / CP, b = micro batch, t = TP, p = bytes per value; per layer the
Gated DeltaNet has n_k key heads of d_k and n_v value heads of d_v (qk = n_k·d_k, v = n_v·d_v), a causal conv of
width w over the 2qk + v channels of q, k, v.

Activations of one Gated DeltaNet layer (its heads split over TP, the whole sequence on every TP rank: in_proj
gathers it under sequence parallelism) — from the saved tensors of the pieces (on CPU, one layer measured with
`planner.measure.SavedTensorMeter`: 8.04 MB for 7.52 MB predicted; the GPU terms are not measured):
- in_proj's output (the conv, the gate, beta and alpha read it): s·b·(2qk + 2v + 2n_v)/t values;
- the conv: its input and the silu's input (2·(2qk + v)/t per token), w shifted taps on CPU (`causal_conv1d`);
- L2-normed q, k repeated to the value heads and v (3 values of n_v·d per token /t), g and beta in fp32;
- the chunked delta rule (64-token chunks C; fp32): per chunk and value head the state entering it (d_k × d_v: the
  recurrent state of one sequence and head is d_k·d_v fp32 values, n_v/t heads per rank) and its C×C intra-chunk
  matrices — one with FLA's kernel (GPU), five with Megatron-Core's torch kernel (CPU), whose row-by-row triangular
  solve also keeps each step's row and block, Σ_{i<C} (i + i²) values (87,360 at C = 64: the largest term on CPU);
- the gated norm's input, the gate and its output (3·v/t per token), out_proj's input (v/t).
"""

from __future__ import annotations

from typing import Any

from model_providers.core.linear_layers import has_linear_attention, linear_pattern

CHUNK = 64  # the chunk length of the delta rule (FLA's and Megatron-Core's torch kernel)


def is_linear_layer(m: Any, index: int | None) -> bool:
    """Global decoder layer `index` is Gated DeltaNet (None: not decided here, full attention)."""
    return index is not None and has_linear_attention(m) and \
        bool(linear_pattern(m.num_layers, m.linear_attention_freq)[index])


def _dims(m: Any) -> tuple[int, int, int]:
    return m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim, \
        m.linear_num_value_heads


def gdn_parameters(m: Any, tp: int, pre: str) -> list[tuple[str, int, bool]]:
    """One Gated DeltaNet's parameters on one TP rank as (name, elements, a GEMM weight), in Megatron-Core's
    registration order (in_proj, conv1d, dt_bias, A_log, out_norm, out_proj); the layer's input norm is the caller's."""
    qk, v, heads = _dims(m)
    h, att = m.hidden_size, f"{pre}.self_attention"
    return [(f"{att}.in_proj.weight", (2 * qk + 2 * v + 2 * heads) // tp * h, True),
            (f"{att}.conv1d.weight", (2 * qk + v) // tp * m.linear_conv_kernel_dim, False),
            (f"{att}.dt_bias", heads // tp, False), (f"{att}.A_log", heads // tp, False),
            (f"{att}.out_norm.weight", m.linear_value_head_dim, False),
            (f"{att}.out_proj.weight", h * v // tp, True)]


def gate_rows(m: Any) -> int:
    """Extra linear_qkv rows of output-gated attention: one gate per query value (heads × head dim, all ranks)."""
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    return m.num_attention_heads * d if getattr(m, "attention_output_gate", False) else 0


def recurrent_state_bytes(m: Any, lay: Any) -> int:
    """The recurrent state of one sequence in one Gated DeltaNet layer on one TP rank (fp32 d_k × d_v per value
    head), and its conv state (w − 1 positions of the 2qk + v channels, activation dtype): what inference keeps per
    sequence and layer, and what each chunk boundary holds in training."""
    qk, v, heads = _dims(m)
    state = 4 * (heads // lay.tp) * m.linear_key_head_dim * m.linear_value_head_dim
    return state + lay.bytes_per_value * (m.linear_conv_kernel_dim - 1) * (2 * qk + v) // lay.tp


def gdn_terms(m: Any, lay: Any) -> dict[str, int]:
    """Bytes one Gated DeltaNet layer's mixer keeps for one microbatch on one rank (see the module doc)."""
    qk, v, heads = _dims(m)
    p, t = lay.bytes_per_value, lay.tp
    s, b = m.seq_length // lay.cp, lay.mbs
    tokens = s * b
    conv = 2 * qk + v
    chunks = b * -(-s // CHUNK)
    taps = 0 if lay.on_gpu else m.linear_conv_kernel_dim * conv // t * tokens * p  # the CPU conv's shifted inputs
    square = 1 if lay.on_gpu else 5
    solve = 0 if lay.on_gpu else sum(i + i * i for i in range(1, CHUNK))
    per_chunk = square * CHUNK * CHUNK + solve + m.linear_key_head_dim * m.linear_value_head_dim
    return {
        "gdn_in_proj": tokens * (conv + v + 2 * heads) // t * p,
        "gdn_conv": 2 * tokens * conv // t * p + taps,
        "gdn_qkv": tokens * (3 * heads * m.linear_value_head_dim) // t * p + 8 * tokens * heads // t,
        "gdn_chunks": chunks * (heads // t) * 4 * per_chunk,
        "attention_output": 4 * tokens * v // t * p,  # norm input, gate, gated output, out_proj input
    }


_ATTENTION_TERMS = ("qkv", "rope_cos_sin", "causal_mask", "scores", "softmax_stats", "attention_output",
                    "cp_ring_output")


def adjust_attention_terms(out: dict[str, int], m: Any, lay: Any, index: int | None) -> dict[str, int]:
    """`activations.layer_terms`' attention terms for this layer: Gated DeltaNet's instead on a linear layer; the
    sigmoid output gate's input and output (2 values per query value) added on output-gated attention."""
    if is_linear_layer(m, index):
        kept = {k: n for k, n in out.items() if k not in _ATTENTION_TERMS}
        return {**kept, **gdn_terms(m, lay)}
    if getattr(m, "attention_output_gate", False):
        s, b = m.seq_length // lay.cp, lay.mbs
        out["attention_gate"] = 2 * s * b * gate_rows(m) // lay.tp * lay.bytes_per_value
    return out
