"""What model building reads, resolved from the config tree once: `ModelPlan` (`pretrain.run_plan.RunPlan.model`).

    chunks = build_model(plan.model, plan.layout)

The model section and the few settings of other sections that shape the built model (the init seed, packed
documents, pipeline and context-parallel communication, the performance section, QK-clip). Model building reads
nothing else of the config tree. No torch import; the config tree is read by attribute (this package sits below
`pretrain`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_providers.core.knobs import QK_CLIP, mcore_kwargs
from model_providers.core.sequences import packed_sequences


@dataclass(frozen=True)
class ModelPlan:
    """The model section and what else of the config the builder needs (see the module docstring)."""

    config: Any  # the model section (pretrain.config.ModelConfig)
    seed: int  # train.seed: the layout-invariant initialisation's generator seed
    packed_documents: bool  # data.reset_attention_mask: microbatches are packed documents (THD)
    batch_p2p_comm: bool | None  # parallel.batch_p2p_comm (None: on GPU only)
    cp_comm_type: str  # parallel.cp_comm_type
    tp_comm_overlap: bool  # parallel.tp_comm_overlap
    performance: Any = None  # the performance section (GPU speed settings), None when the tree has none
    qk_clip: tuple = ()  # Megatron-Core's QK-clip fields as (name, value) pairs; () when off


def model_plan(cfg: Any) -> ModelPlan:
    """The `ModelPlan` of a config tree (`pretrain.config.Config`)."""
    o, p = cfg.optimizer, cfg.parallel
    clip = ()
    if o.name == "muon" and o.muon.qk_clip:  # optimizer.muon's fields declared mcore=QK_CLIP
        clip = tuple(mcore_kwargs(o.muon, QK_CLIP).items())
    return ModelPlan(config=cfg.model, seed=cfg.train.seed, packed_documents=packed_sequences(cfg.data),
                     batch_p2p_comm=p.batch_p2p_comm, cp_comm_type=p.cp_comm_type,
                     tp_comm_overlap=p.tp_comm_overlap, performance=getattr(cfg, "performance", None), qk_clip=clip)
