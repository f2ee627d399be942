"""Pretraining on Megatron-Core: config, validation, training loop, checkpoints, metrics, planner."""

import os
import warnings

# megatron-core's package_info runs `git rev-parse` in its own install directory at every import and appends the
# commit to its __version__; our venvs live inside our checkout, so it would stamp *our* commit on *its* version
# (0.19.2+<ours>). Its version stays the plain release (what the package metadata says), and no git call.
os.environ.setdefault("NO_VCS_VERSION", "1")

# Expected on machines without Transformer Engine / apex (CPU, plain GPUs): Megatron-Core says at import that
# it uses its local implementations. Not something a user must act on, so not shown.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).* not installed.*")
warnings.filterwarnings("ignore", message="full scope is deprecated")
