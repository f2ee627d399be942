#!/usr/bin/env bash
# One-command GPU check (under 8 minutes on one H100/H200): few-layer models at Llama-3-8B and Llama-3-70B
# width, bf16 local spec and, when Transformer Engine imports, the TE spec and TE + FP8: tokens/s/GPU,
# TFLOP/s/GPU, MFU, peak memory measured vs planned, activations measured vs planned, and the trainer's
# throughput against a minimal loop calling Megatron-Core directly (our overhead). Details: tests/gpu/check.py.
#
#   tests/gpu/run.sh                  # the interpreter: $PYTHON, else the checkout's .venv, else python3
#   tests/gpu/run.sh --json-out F     # also the figures as JSON
#   tests/gpu/run.sh --dry-run        # the cases and their planned memory; runs nothing (no GPU needed)
#
# Works with a system Python that has torch and the project installed (README "Offline install"), no venv.
# On a machine without a CUDA GPU it says so and exits 0. When torch, the project or megatron-core fails to import,
# or the machine has NVIDIA devices torch cannot use, it says what failed and exits 1 (tests/gpu/preflight.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" tests/gpu/check.py "$@"
