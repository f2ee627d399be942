"""Which global batch every step takes: Megatron-Core's microbatch calculator (`train.rampup_batch_size`, its
batch-size ramp-up, or the constant `train.global_batch_size`), walked over a stage's steps.

The batch of a step is the calculator's at the samples consumed before it (global: counted from the run's first
step, across stages), as the trainer asks it (`pretrain.run.setup.advance_batch`). While a ramp runs the walk goes
step by step; once the calculator's batch is constant (consumed > ramp_samples) it is arithmetic. Megatron-Core is
imported only when there is a ramp (`validate` of a config without one imports no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StageSamples:
    """What a stage's steps consume: steps, samples, tokens (samples × sequence length) and the global batch sizes
    they take (ascending)."""

    steps: int
    samples: int
    tokens: int
    batch_sizes: tuple[int, ...]


class TokensNotExact(ValueError):
    """A stage's `tokens` is no whole number of its steps' batches: the counts just below and above, in steps."""

    def __init__(self, below: tuple[int, int], above: tuple[int, int]):
        super().__init__(f"{below} {above}")
        self.below, self.above = below, above  # (steps, tokens)


def walk(ramp: list[int] | None, global_batch_size: int, first_sample: int, seq_length: int, *,
         steps: int | None = None, tokens: int | None = None) -> StageSamples:
    """The samples of a stage starting at `first_sample` consumed samples that runs `steps` steps, or as many as
    consume `tokens` tokens (`TokensNotExact` when no whole number of steps does)."""
    calculator = None
    if ramp is not None:
        from pretrain.compat.mcore import microbatch_calculator

        calculator = microbatch_calculator(ramp, global_batch_size, 1, 1)
    n, consumed, done, last, sizes = 0, first_sample, 0, 0, set()
    while (steps is not None and n < steps) or (tokens is not None and done < tokens):
        if calculator is None or consumed > int(ramp[2]):  # the batch is constant from here on
            per_step = global_batch_size * seq_length
            k = steps - n if steps is not None else math.ceil((tokens - done) / per_step)
            sizes.add(global_batch_size)
            n, consumed, done, last = n + k, consumed + k * global_batch_size, done + k * per_step, per_step
            break
        calculator.update(consumed, False)
        batch = calculator.get_current_global_batch_size()
        sizes.add(batch)
        n, consumed, done, last = n + 1, consumed + batch, done + batch * seq_length, batch * seq_length
    if tokens is not None and done != tokens:
        raise TokensNotExact((n - 1, done - last), (n, done))
    return StageSamples(n, consumed - first_sample, done, tuple(sorted(sizes)))


def ramp_steps(ramp: list[int], global_batch_size: int) -> tuple[int, int]:
    """(steps, samples) a ramp takes before its batch is `global_batch_size` (Megatron-Core's calculator)."""
    from pretrain.compat.mcore import microbatch_calculator

    calculator = microbatch_calculator(ramp, global_batch_size, 1, 1)
    steps, consumed = 0, 0
    while True:
        calculator.update(consumed, False)
        batch = calculator.get_current_global_batch_size()
        if batch == global_batch_size:
            return steps, consumed
        steps, consumed = steps + 1, consumed + batch
