#!/usr/bin/env bash
# One-command GPU check (under 8 minutes on one H100/H200): trains few-layer models at Llama-3-8B and
# Llama-3-70B width in bf16 with the local spec, and with the Transformer Engine spec and FP8 when TE is
# installed, then prints tokens/s/GPU, TFLOP/s, MFU and peak memory measured vs planned.
#
#   tests/gpu/run.sh            # PYTHON=/path/to/python to choose the interpreter
#
# On a machine without a CUDA GPU it prints a message and exits 0.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "tests/gpu/run.sh: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check. Run it on an H100/H200."
  exit 0
fi
exec "$PYTHON" tests/gpu/check.py "$@"
