"""A run in stages (`stages:` in the config): data mixtures, annealing, long-context extension, one config.

- `spec`: the `stages:` list parsed and each stage's config resolved from the config alone (no torch): its `set`
  applied to the config before it, its length in steps, the run's length the stages' sum;
- `samples`: which global batch every step takes (Megatron-Core's microbatch calculator, batch-size ramp-up
  included): a stage's steps from its tokens, the samples consumed before each stage;
- `plan`: every stage resolved as a run (`pretrain.run_plan`), their problems in one report naming the stage;
- `boundaries`: what the trainer does at a stage's start and end (the stage's data position in the checkpoint,
  the boundary checkpoint named for the stage, in this process or with exit code 76).

docs/training.md "Stages" says what users can rely on.
"""
