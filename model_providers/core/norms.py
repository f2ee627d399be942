"""Norms of the local (CPU) spec that torch's own do not provide.

- `ZeroCenteredNorm`: Megatron-Core's `layernorm_zero_centered_gamma` (Transformer Engine's `zero_centered_gamma`):
  the stored weight w scales by (1 + w), so it starts at 0 (Qwen3-Next's `Qwen3NextRMSNorm`, Gemma's). Computed in
  fp32 and cast back, as transformers' and TE's are.
- `HeadNorm`: the norm of Gated DeltaNet's output, over one value head (`GatedDeltaNet.out_norm`), zero-centred with
  the model's other norms as Megatron-Core builds it. Every tensor-parallel rank normalises its own heads with the one
  shared weight, so the weight's gradient is a partial sum per rank: it is summed over the tensor-parallel group in
  the backward pass (`copy_to_tensor_model_parallel_region`), whatever the sequence parallelism. (Megatron-Core's
  finalize step sums it only when it is marked `sequence_parallel`, which a TE norm is under sequence parallelism
  alone; it is not marked here, so it is summed once.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ZeroCenteredNorm(torch.nn.Module):
    """RMSNorm (or LayerNorm) with weight (1 + w); parameter names `weight` (and `bias`) as torch's norms'."""

    def __init__(self, hidden_size: int, eps: float, rms: bool = True, dtype: torch.dtype | None = None):
        super().__init__()
        self.hidden_size, self.eps, self.rms = hidden_size, eps, rms
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.bias = None if rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def scale(self) -> torch.Tensor:
        """The weight as the norm applies it: 1 + w, in fp32."""
        return 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.hidden_size,)
        if self.rms:
            y = F.rms_norm(x.float(), shape, None, self.eps) * self.scale()
        else:
            y = F.layer_norm(x.float(), shape, self.scale(), self.bias.float(), self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero-centred {'RMSNorm' if self.rms else 'LayerNorm'}"


class HeadNorm(ZeroCenteredNorm):
    """Gated DeltaNet's per-head output norm (a spec module: `config`, `hidden_size`, `eps`), see the module doc."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps, rms=config.normalization == "RMSNorm", dtype=config.params_dtype)
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        if not self.zero_centered:
            with torch.no_grad():
                self.weight.fill_(1.0)

    def scale(self) -> torch.Tensor:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        weight = self.weight
        if parallel_state.model_parallel_is_initialized() and \
                parallel_state.get_tensor_model_parallel_world_size() > 1:
            weight = copy_to_tensor_model_parallel_region(weight)
        return weight.float() + 1.0 if self.zero_centered else weight.float()
