"""The memory plan of one rank: static memory + activations + transient buffers at the peak."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config import Config
from pretrain.planner.activations import activation_memory
from pretrain.planner.common import GIB, Layout
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

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.fp8 + self.buffers

    def gib(self) -> dict[str, float]:
        keys = ("weights", "gradients", "optimizer", "activations", "fp8", "buffers", "total")
        return {k: round(getattr(self, k) / GIB, 3) for k in keys}


def rank_memory(cfg: Config, lay: Layout, padded_vocab: int, pp_rank: int, *, fused_adam: bool = True) -> RankMemory:
    """Peak memory of the most loaded data-parallel rank of pipeline stage `pp_rank`.

    The peak is the larger of the backward peak (static + activations + transient buffers) and the
    optimizer step (static + torch Adam's foreach temporaries when there is no fused Adam).
    """
    st = static_memory(cfg, lay, padded_vocab, pp_rank)
    act = activation_memory(cfg, lay, padded_vocab, pp_rank)
    buffers = act.transient + st.largest_param * lay.bytes_per_value  # one weight grad before accumulation
    if not fused_adam:
        buffers = max(buffers, st.optimizer_moments // 2 - act.saved)  # torch foreach Adam: sqrt(v) copy
    return RankMemory(pp_rank=pp_rank, params=st.params, weights=st.weights, gradients=st.gradients,
                      optimizer=st.optimizer, activations=act.saved, fp8=st.fp8, buffers=buffers,
                      in_flight=act.in_flight)


def most_loaded(cfg: Config, lay: Layout, padded_vocab: int, fused_adam: bool = True) -> RankMemory:
    """The rank with the largest planned peak (first and last pipeline stages are the candidates)."""
    stages = sorted({0, lay.pp - 1})
    return max((rank_memory(cfg, lay, padded_vocab, r, fused_adam=fused_adam) for r in stages),
               key=lambda rm: rm.total)
