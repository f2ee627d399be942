"""The planner. Know before you launch: per-GPU memory, FLOPs and throughput of a config on a cluster.

    python -m pretrain plan CONFIG [overrides] --nodes N --gpus-per-node G [--gpu h100] [--json] [--search]

Memory per rank is computed from the shapes Megatron-Core allocates, not from rules of thumb:

- weights: every parameter of this rank's model chunks (the tensor-parallel shard of each matrix, this
  pipeline stage's layers, embedding on the first stage, output layer on the last); with the distributed
  optimizer the DDP contiguous parameter buffer, padded as Megatron pads it.
- gradients: DDP's contiguous gradient buffers (fp32 with optimizer.grad_reduce_in_fp32), padded likewise.
- optimizer: Adam's two fp32 moments plus fp32 main parameters (bf16/fp16 only) for the elements this
  rank owns — all of them, or its data-parallel(×context-parallel) shard of every DDP bucket with the
  distributed optimizer.
- activations: what autograd keeps per microbatch per layer (see `layer_activation_bytes`), times the
  microbatches in flight on this stage under 1F1B (interleaving keeps more), with sequence parallelism,
  context parallelism and recomputation applied; plus the embedding/loss extras of first/last stages.
- fp8: Transformer Engine's FP8 copy and transposed copy of every linear weight.
- buffers: transient working memory at the backward peak (sequence-parallel all-gather buffer, local
  attention's score buffer and its softmax backward, pipeline send/receive buffers, the bf16 logits, one weight
  gradient before it is accumulated into the fp32 buffer, one recomputed group).

Not modelled: the CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation (the planner keeps
`fit_limit_gib`: a reserve and a fragmentation share of the GPU free for them).

The package, by concern: `common` (GPU table, `Layout`, padded vocabulary, validator verdict), `census`
(parameters), `static` (DDP buffers, optimizer state), `activations`, `memory` (one rank's peak), `cost`
(step-time model), `search`, `plan` (the JSON-ready plan), `report` (text), `cli`, `measure` (counting
the bytes autograd saves, to check `activations` against real ranks).
"""

from pretrain.layout import Layout
from pretrain.planner.activations import ActivationMemory, activation_memory, in_flight, layer_activation_bytes
from pretrain.planner.census import (
    Param,
    chunk_parameters,
    count_active_parameters,
    count_checkpoint_elements,
    count_mtp_parameters,
    count_parameters,
    layer_parameters,
)
from pretrain.planner.common import (
    DEFAULT_MFU,
    GEMM_EFFICIENCY,
    GIB,
    GPU_MEMORY_GIB,
    HEADROOM,
    NETWORK_GBPS,
    NVLINK_GBPS,
    PlanError,
    check_layout,
    fit_limit_gib,
    layout_of,
    padded_vocab_for,
)
from pretrain.planner.cost import FORMULA, Cost, cost_model
from pretrain.planner.memory import RankMemory, most_loaded, rank_memory
from pretrain.planner.plan import make_plan
from pretrain.planner.report import format_plan, format_search
from pretrain.planner.search import search
from pretrain.planner.static import Buffer, StaticMemory, ddp_buffer, optimizer_elements, static_memory

__all__ = [
    "DEFAULT_MFU", "FORMULA", "GEMM_EFFICIENCY", "GIB", "GPU_MEMORY_GIB", "HEADROOM", "NETWORK_GBPS",
    "NVLINK_GBPS", "ActivationMemory", "fit_limit_gib", "Buffer", "Cost", "Layout", "Param", "PlanError", "RankMemory",
    "StaticMemory", "activation_memory", "check_layout", "chunk_parameters", "cost_model", "count_parameters",
    "count_active_parameters", "count_checkpoint_elements", "count_mtp_parameters",
    "ddp_buffer", "format_plan", "format_search", "in_flight", "layer_activation_bytes", "layer_parameters",
    "layout_of", "make_plan", "most_loaded", "optimizer_elements", "padded_vocab_for", "rank_memory", "search",
    "static_memory",
]  # fmt: skip
