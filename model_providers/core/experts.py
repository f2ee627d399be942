"""Local-spec experts with biases (GPT-OSS): the smallest piece Megatron-Core's CPU path needs.

Two things Megatron-Core's `RowParallelLinear` (0.16.1–0.19) gets wrong for an expert's fc2 with a bias, which
Megatron-Core allows only at expert tensor parallelism 1:
- `SequentialMLP` runs each expert as an `MLP` that adds the fc2 bias, scaled by the routing weight, in place onto
  the fc2 output (`output += output_bias · per_token_scale`, `transformer/mlp.py`); with expert TP 1 the layer's
  all-reduce is skipped and its autograd function returns its input as is, so autograd refuses the in-place add
  ("a view ... modified inplace"). The output here is a fresh tensor: same numbers.
- it marks the bias `sequence_parallel` whenever the model uses sequence parallelism, so `finalize_model_grads`
  all-reduces its gradient over the (dense) tensor-parallel group, on top of the expert-data-parallel reduction that
  already sums every rank's tokens (with expert TP 1 the TP ranks are expert-data-parallel ranks): under TP2 + SP
  the gradient doubles (measured: the gradient norm of tiny_gpt_oss 22% above one rank's). Here the bias is not
  marked: its gradient is reduced once, over expert data parallelism, as the expert weights' are;
- it leaves the bias without `tensor_model_parallel`, so the gradient norm counts it only on tensor-parallel rank 0
  (`param_is_not_tensor_parallel_duplicate` reads the dense TP rank): under TP2 × EP2 the experts of TP rank 1 lose
  their fc2 biases from the norm (measured: 4.5% below one rank's). With expert TP 1 no expert parameter has a
  tensor-parallel duplicate, so the bias is marked as the expert weights are (split in one part).
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear


class ExpertRowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` for an expert's fc2 with a bias: its output may be modified in place, its bias gradient
    is reduced and counted in the gradient norm as the expert weights are."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bias is not None:
            self.bias.sequence_parallel = False
            self.bias.tensor_model_parallel = True
            self.bias.partition_dim = 0
            self.bias.partition_stride = 1

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return output.clone(), bias
