"""Context parallelism and packed sequences (THD) in the activation model.

Under CP a rank holds s/CP tokens of each microbatch, so every per-token term of `pretrain.planner.activations`
shrinks by CP (its `s` is seq/CP already). What attention itself keeps depends on the implementation:

- Transformer Engine (GPU): Q, K, V of the local tokens, the output and the softmax statistics, whatever the comm
  type (`context_parallel.py`: the p2p ring and all-gather save the local K/V and gather or pass them again in
  backward; a2a saves its head-split Q/K/V, the same bytes): the TE terms of `activations.layer_terms`, unchanged.
- The local spec's CPU attention (`model_providers/core/cp_attention.py`, with CP > 1 or packed documents),
  measured on CPU ranks (tests/pretrain/test_plan.py):
  - all_gather: Q, the gathered K and V expanded to the rank's heads (CP× the local tokens), the mask [s/CP, s]
    and the fp32 softmax [b, a/t, s/CP, s] (+ its p-byte copy);
  - a2a: Q, K, V of all tokens on a/CP heads (expanded: the local tokens' worth), the mask [s, s] and the same
    softmax bytes;
  - p2p: the ring's inputs (Q, K and V, a view of the fused QKV output, which stays whole), its fp32 output and
    log-sum-exp: no s² term is kept; the s²/CP working set lives only inside the forward and backward of a layer.

Packed documents (THD) pack a microbatch into one sequence of b·s tokens (b = 1), padded by up to 2·CP − 1 tokens
per document under CP (not counted): per-token terms are unchanged, the CPU attention's score terms are those of
a b·s sequence (b times a bshd microbatch's). Transformer Engine's THD attention keeps per-token terms only.

Each function reads the `ModelPlan` (`model_providers.core.model_plan`: the model section, packed documents, the CP
communication type): what the model builder reads to build the attention these terms describe.
"""

from __future__ import annotations

from model_providers.core.model_plan import ModelPlan
from pretrain.layout import Layout


def uses_cpu_cp_attention(mp: ModelPlan, lay: Layout) -> bool:
    """The local spec's core attention is `ContextParallelAttention` (CP > 1 or packed documents)."""
    return not lay.use_te and (lay.cp > 1 or mp.packed_documents)


def attention_shape(mp: ModelPlan, lay: Layout) -> tuple[int, int, int]:
    """(b, local queries, keys) of one attention call: THD packs the micro batch into one sequence."""
    s, b = mp.config.seq_length, lay.mbs
    if mp.packed_documents:
        s, b = s * b, 1
    return b, s // lay.cp, s


def cpu_attention_terms(mp: ModelPlan, lay: Layout, sbd: int, qkv_units: int, expanded_units: int) -> dict[str, int]:
    """Bytes the CPU context-parallel attention keeps for backward (one layer, one microbatch).

    `sbd`: one head's values on this rank (s/CP·b·d/t); `qkv_units`: what the ring's inputs keep, in those units
    (Q, K and the fused QKV output V is a view of); `expanded_units`: Q plus K/V expanded to all heads (3·a).
    """
    p = lay.bytes_per_value
    a = mp.config.num_attention_heads
    heads = a // lay.tp
    b, sq, sk = attention_shape(mp, lay)
    comm, cp = mp.cp_comm_type, lay.cp
    scores = (4 + (p if p != 4 else 0)) * b * heads * sq * sk  # fp32 softmax and its p-byte copy
    if cp > 1 and comm == "p2p":
        return {"qkv": qkv_units * sbd * p, "cp_ring_output": 4 * a * sbd + 4 * b * heads * sq}
    if cp > 1 and comm == "all_gather":  # Q local; K and V gathered and expanded: CP times the local tokens
        return {"qkv": (a + 2 * a * cp) * sbd * p, "causal_mask": sq * sk, "scores": scores}
    if cp > 1:  # a2a: Q, K, V of every token on a/CP heads; the mask covers the whole sequence
        return {"qkv": 3 * a * sbd * p, "causal_mask": sk * sk, "scores": scores}
    return {"qkv": expanded_units * sbd * p, "causal_mask": sq * sk, "scores": scores}


def cpu_recompute_working_set(mp: ModelPlan, lay: Layout, terms: dict[str, int], head: int) -> int:
    """What recomputing the CPU attention rebuilds beyond the checkpoint's Q, K, V (`terms`: the layer's terms
    without recompute; `head`: one head's bytes on this rank, s/CP·b·d/t·p)."""
    a, g = mp.config.num_attention_heads, lay.num_query_groups
    comm, cp = mp.cp_comm_type, lay.cp
    if cp > 1 and comm == "p2p":
        return terms["cp_ring_output"]
    if cp > 1 and comm == "all_gather":
        rebuilt = 2 * a * cp * head  # the gathered, expanded K and V
    elif cp > 1:
        rebuilt = 3 * a * head  # Q, K, V after the all-to-all
    else:
        rebuilt = 2 * a * head if g < a else 0  # K and V expanded to all heads
    return rebuilt + terms["causal_mask"] + terms["scores"]


def cpu_attention_working_set(mp: ModelPlan, lay: Layout) -> int:
    """CPU only: the s²/CP score bytes the CPU attention materialises per layer while it runs (scores, fp32
    softmax, its copy; the p2p ring one K/V block at a time)."""
    if not uses_cpu_cp_attention(mp, lay):
        return 0
    p = lay.bytes_per_value
    b, sq, sk = attention_shape(mp, lay)
    heads = mp.config.num_attention_heads // lay.tp
    if lay.cp > 1 and mp.cp_comm_type == "p2p":
        sk = sq  # one block of the ring: the rank's queries against one rank's keys
    return b * heads * sq * sk * (p + 4 + 4)


def cp_comm_bytes(mp: ModelPlan, lay: Layout) -> float:
    """Bytes one rank sends for context-parallel attention per layer and microbatch (forward + backward).

    p2p and all_gather move K and V: (CP−1)·2·(s/CP)·b·g·d/t·p in the forward (ring steps / the gather), twice
    that in the backward (K/V again, their gradients); a2a moves (CP−1)/CP of Q, K, V and the output, forward
    and backward: 2·(CP−1)/CP·(s/CP)·b·(2a + 2g)·d/t·p. Recomputed core attention runs the forward again.
    """
    if lay.cp <= 1:
        return 0.0
    m = mp.config
    p, cp = lay.bytes_per_value, lay.cp
    s, b, d = m.seq_length // cp, lay.mbs, lay.head_dim
    heads, groups = m.num_attention_heads / lay.tp, max(lay.num_query_groups / lay.tp, 1)
    again = m.recompute_granularity == "full" or (
        m.recompute_granularity == "selective" and "core_attn" in (m.recompute_modules or ("core_attn",)))
    if mp.cp_comm_type == "a2a":
        forward = (cp - 1) / cp * s * b * (2 * heads + 2 * groups) * d * p
        return forward * (3 if again else 2)
    forward = (cp - 1) * 2 * s * b * groups * d * p
    return forward * (4 if again else 3)


def context_summary(mp: ModelPlan, lay: Layout, layer_terms) -> dict | None:
    """The plan's `context_parallel` entry (None without CP or packed documents): the comm type, the bytes a
    rank sends per layer and microbatch, and — CPU only — what the local spec's CP attention would keep and work on
    per layer in a CPU dry run of this layout (Transformer Engine replaces it on GPUs). `layer_terms`:
    `pretrain.planner.activations.layer_terms`."""
    from dataclasses import replace

    thd = mp.packed_documents
    if lay.cp <= 1 and not thd:
        return None
    cpu = replace(lay, use_te=False, on_gpu=False)
    terms = layer_terms(mp, cpu)
    saved = sum(v for k, v in terms.items() if k in ("qkv", "causal_mask", "scores", "cp_ring_output"))
    return {"context": lay.cp, "cp_comm_type": mp.cp_comm_type if lay.cp > 1 else None,
            "packed_documents": thd, "comm_bytes_per_layer_microbatch": cp_comm_bytes(mp, lay),
            "cpu_only": {"attention_saved_bytes_per_layer": saved,
                         "attention_working_set_bytes_per_layer": cpu_attention_working_set(mp, cpu)}}
