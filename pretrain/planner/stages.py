"""Per-pipeline-stage accounting for explicit placements (`parallel.pipeline_layout`,
`parallel.account_for_{embedding,loss}_in_pipeline_split`): the training FLOPs each pipeline rank runs per token
(`plan --json`'s `stage_flops_per_token`) and which ranks can hold the memory peak (every one; the even split and
uneven first / last stages keep the first / last stage view). The step time is per rank already
(`pretrain.planner.timing.rank_work` reads `Layout.chunk_layers`): the busiest stage sets the pace.
"""

from __future__ import annotations

import dataclasses

from pretrain.config import ModelConfig
from pretrain.layout import Layout
from pretrain.observe.flops import flops_per_token


def explicit(lay: Layout) -> bool:
    """The placement is a layout string or counts the embedding / loss in the split. (Uneven first / last stages
    keep the planner's first / last stage view and its even-split compute, as before these placements.)"""
    return lay.pipeline_layout is not None or lay.embedding_in_split or lay.loss_in_split


def rank_layers(m: ModelConfig, lay: Layout) -> list[int]:
    """Decoder layers on each pipeline rank (all its virtual stages)."""
    n = m.num_layers
    return [sum(lay.chunk_layers(n, r, v)[1] for v in range(lay.vp)) for r in range(lay.pp)]


def stage_flops(m: ModelConfig, lay: Layout, padded_vocab: int) -> list[float]:
    """Training FLOPs per token of each pipeline rank: its decoder layers (at the model's mean per layer), the
    output layer and loss on the last rank, the MTP layers (with their output layer) on theirs. They sum to
    `flops_per_token`."""
    total = flops_per_token(m, padded_vocab)
    without_mtp = flops_per_token(dataclasses.replace(m, mtp_num_layers=None), padded_vocab)
    logits = 6.0 * m.hidden_size * padded_vocab
    per_layer = (without_mtp - logits) / m.num_layers
    out = [per_layer * k for k in rank_layers(m, lay)]
    out[-1] += logits
    if m.mtp_num_layers:
        out[lay.mtp_chunk[0]] += total - without_mtp
    return out


def memory_candidates(lay: Layout) -> list[int]:
    """Pipeline ranks whose memory the planner sizes: first and last for the even split, every rank otherwise."""
    return list(range(lay.pp)) if explicit(lay) else sorted({0, lay.pp - 1})
