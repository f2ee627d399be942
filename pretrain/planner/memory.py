"""The memory plan of one rank: static memory + activations + transient buffers at the peak."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config import Config
from pretrain.layout import Layout
from pretrain.planner.activations import activation_memory
from pretrain.planner.common import GIB
from pretrain.planner.stages import memory_candidates
from pretrain.planner.static import static_memory


@dataclass
class RankMemory:
    """The memory plan of one rank, in bytes."""

    pp_rank: int
    params: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    fp8: int
    buffers: int
    in_flight: dict[int, int]
    expert_params: int = 0  # of `params`, MoE expert weights

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.fp8 + self.buffers

    def gib(self) -> dict[str, float]:
        keys = ("weights", "gradients", "optimizer", "activations", "fp8", "buffers", "total")
        return {k: round(getattr(self, k) / GIB, 3) for k in keys}


# Transformer Engine's userbuffers (`initialize_ub`): one communicator per overlapped GEMM, each a buffer of
# the global [s·b, h] shape; the all-gather ones hold FP8 (uint8) under FP8, the others the activation dtype.
UB_ALL_GATHER = ("qkv_fprop", "qkv_dgrad", "proj_dgrad", "proj_wgrad", "fc1_fprop", "fc1_dgrad", "fc2_dgrad",
                 "fc2_wgrad")
UB_OTHERS = ("proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad")


def userbuffer_bytes(cfg: Config, lay: Layout) -> int:
    """GPU memory of TE's TP-communication-overlap buffers (parallel.tp_comm_overlap), else 0."""
    if not (cfg.parallel.tp_comm_overlap and lay.use_te and lay.tp > 1):
        return 0
    elems = cfg.model.seq_length * lay.mbs // lay.cp * cfg.model.hidden_size
    ag = 1 if cfg.model.fp8 else lay.bytes_per_value
    return elems * (len(UB_ALL_GATHER) * ag + len(UB_OTHERS) * lay.bytes_per_value)


def rank_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int, *, fused_adam: bool = True,
                gpu: str | None = None) -> RankMemory:
    """Peak memory of the most loaded data-parallel rank of pipeline stage `pp_rank` on a `gpu` (its kind decides
    Transformer Engine's FP8 transposes, `planner.precision`; None: Hopper's).

    The peak is the larger of the backward peak (static + activations + transient buffers, TE userbuffers) and
    the optimizer step (static + torch Adam's foreach temporaries when there is no fused Adam; + the layer-wise
    Muon optimizer's all-gather buffers).
    """
    gathered = 0
    if lay.fsdp_sharding:  # Megatron-FSDP: sharded buffers, plus the all-gathered units in use
        from pretrain.planner.fsdp import fsdp_memory

        fm = fsdp_memory(cfg, lay, padded_vocab, pp_rank, gpu)
        st, gathered = fm.static, fm.working_set
    else:
        st = static_memory(cfg, lay, padded_vocab, pp_rank, gpu=gpu)
    act = activation_memory(cfg, lay, padded_vocab, pp_rank)
    buffers = act.transient + st.largest_param * lay.bytes_per_value  # one weight grad before accumulation
    buffers += gathered
    buffers += userbuffer_bytes(cfg, lay)
    if not fused_adam:
        buffers = max(buffers, st.optimizer_moments // 2 - act.saved)  # torch foreach Adam: sqrt(v) copy
    if cfg.optimizer.name == "muon" and cfg.optimizer.muon.layer_wise:  # its all-gather after the step
        from pretrain.planner.muon import muon_memory

        buffers = max(buffers, muon_memory(cfg, lay, padded_vocab, pp_rank).gather_bytes - act.saved)
    return RankMemory(pp_rank=pp_rank, params=st.params, weights=st.weights, gradients=st.gradients,
                      optimizer=st.optimizer, activations=act.saved, fp8=st.fp8, buffers=buffers,
                      in_flight=act.in_flight, expert_params=st.expert_params)


def most_loaded(cfg: Config, lay: Layout, padded_vocab: int, fused_adam: bool = True,
                gpu: str | None = None) -> RankMemory:
    """The rank with the largest planned peak (first and last pipeline stages are the candidates; every stage for
    an explicit placement)."""
    stages = memory_candidates(lay)
    return max((rank_memory(cfg, lay, padded_vocab, r, fused_adam=fused_adam, gpu=gpu) for r in stages),
               key=lambda rm: rm.total)
