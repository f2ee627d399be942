"""Pretraining on Megatron-Core: config, validation, training loop, checkpoints, metrics, planner."""

import warnings

# Expected on machines without Transformer Engine / apex (CPU, plain GPUs): Megatron-Core says at import that
# it uses its local implementations. Not something a user must act on, so not shown.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")
warnings.filterwarnings("ignore", message="full scope is deprecated")
