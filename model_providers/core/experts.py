"""Local-spec experts with biases (GPT-OSS): the smallest piece Megatron-Core's CPU path needs.

`SequentialMLP` runs each expert as an `MLP` that adds its fc2 bias, scaled by the routing weight, in place onto the
fc2 output (`output += output_bias · per_token_scale`, `transformer/mlp.py`, 0.16.1–0.19). With expert tensor
parallelism 1 (which Megatron-Core requires for expert biases) `RowParallelLinear`'s all-reduce is skipped and its
autograd function returns its input as is, so autograd refuses the in-place add ("a view ... modified inplace").
`ExpertRowParallelLinear` is `RowParallelLinear` returning a fresh tensor: same parameters, same numbers.
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear


class ExpertRowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` whose output may be modified in place (an expert's fc2 with a bias)."""

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return output.clone(), bias
