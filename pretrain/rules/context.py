"""Context-parallel rules: what Transformer Engine (GPU) and the local spec's CP attention (CPU) can run.

Both take `parallel.cp_comm_type` (Megatron's `cp_comm_type`): the same key means the same algorithm on either.
"""

from __future__ import annotations

from packaging.version import Version

from model_providers.core.sequences import variable_seq_lengths
from pretrain.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from pretrain.layout import Layout, model_shape, use_transformer_engine
from pretrain.problems import Report

# Transformer Engine releases from which its CP attention takes packed sequences (THD) per comm type; before them
# it asserts `qkv_format != "thd"` (checked in the v2.9, v2.10, v2.14 and v2.15 sources of context_parallel.py).
TE_THD_SINCE = {"p2p": "1.10", "a2a": "2.10", "all_gather": "2.15"}


def _installed_te() -> str | None:
    from pretrain.compat import matrix

    return matrix.installed().transformer_engine


def context_rules(r: Report, *, model: ModelConfig, parallel: ParallelConfig, data: DataConfig, train: TrainConfig,
                  lay: Layout | None, te_on_gpu: bool) -> None:
    """parallel.cp_comm_type, the head / sequence splits each needs, packed documents, the CPU attention's notes."""
    m, p, d = model, parallel, data
    if p.context <= 1:
        return
    cp, tp, comm = p.context, p.tensor, p.cp_comm_type
    use_te = lay.use_te if lay is not None else use_transformer_engine(m.transformer_impl, te_on_gpu)
    if comm == "a2a+p2p":
        r.error(("parallel.cp_comm_type", "parallel.context"),
                "parallel.cp_comm_type=a2a+p2p needs hierarchical context-parallel groups (Megatron's "
                "hierarchical_context_parallel_sizes), which this trainer does not build",
                "use parallel.cp_comm_type=p2p, a2a or all_gather")
    shape = model_shape(m)
    heads, groups = m.num_attention_heads // max(tp, 1), max(shape.num_query_groups // max(tp, 1), 1)
    if comm == "a2a" and (heads % cp or groups % cp):
        r.error(("parallel.cp_comm_type", "parallel.context", "model.num_attention_heads", "model.num_query_groups"),
                f"parallel.cp_comm_type=a2a gives each CP rank 1/{cp} of a tensor-parallel rank's attention heads "
                f"({heads}) and query groups ({groups}): both must be divisible by parallel.context={cp}",
                "use parallel.cp_comm_type=p2p or all_gather, or a context size dividing both")
    if p.sequence_parallel and tp > 1 and not d.reset_attention_mask and (m.seq_length // cp) % tp:
        r.error(("model.seq_length", "parallel.context", "parallel.tensor", "parallel.sequence_parallel"),
                f"a CP rank's {m.seq_length // cp} tokens (model.seq_length / parallel.context) do not split "
                f"over parallel.tensor={tp} sequence-parallel ranks",
                f"use a sequence length that is a multiple of {cp * tp * (1 if tp % 2 == 0 else 2)}")
    if d.reset_attention_mask and use_te and te_on_gpu:
        te = _installed_te()
        since = TE_THD_SINCE.get(comm)
        if te is not None and since is not None and Version(te) < Version(since):
            r.error(("data.reset_attention_mask", "parallel.cp_comm_type"),
                    f"Transformer Engine {te} takes packed sequences (THD, per-document masks) with "
                    f"cp_comm_type={comm} only from {since} on", "use parallel.cp_comm_type=p2p, or a newer TE")
    if lay is not None and lay.moe and m.moe_token_dispatcher_type == "allgather" and variable_seq_lengths(data, lay):
        r.error(("model.moe_token_dispatcher_type", "data.reset_attention_mask", "parallel.context",
                 "parallel.pipeline"),
                "packed documents under context × pipeline parallelism have a padded length per microbatch "
                "(Megatron's variable_seq_lengths), which Megatron-Core's allgather token dispatcher does not support",
                "use model.moe_token_dispatcher_type=alltoall")
    vp = p.virtual_pipeline
    if d.reset_attention_mask and p.pipeline == 2 and vp and not (lay.on_gpu if lay is not None else te_on_gpu):
        r.error(("data.reset_attention_mask", "parallel.context", "parallel.virtual_pipeline"),
                "packed documents under context parallelism have a padded length per microbatch, which pipeline "
                "stages exchange before each tensor; with interleaving on 2 stages gloo pairs those same-peer "
                "messages first-in-first-out and can swap them", "use parallel.pipeline >= 3, or no interleaving")
    if not use_te:
        b, s = (1, m.seq_length * train.micro_batch_size) if d.reset_attention_mask else (
            train.micro_batch_size, m.seq_length)
        if comm == "p2p":
            what = f"computes [{b}, {heads}, {s // cp}, {s // cp}] score blocks around the ring (none kept)"
        else:
            what = f"keeps [{b}, {heads}, {s // cp}, {s}] attention scores per layer for backward (s²/CP)"
        r.notes.append(f"context parallelism without Transformer Engine: model_providers/core/cp_attention.py "
                       f"(cp_comm_type={comm}) {what}; Transformer Engine's fused attention keeps only softmax "
                       "statistics")
    if m.attention_dropout > 0:
        r.notes.append(f"model.attention_dropout={m.attention_dropout} under context parallelism: each CP rank "
                       "draws its own dropout masks, so losses match a one-rank run in distribution, not exactly")
