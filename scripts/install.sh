#!/usr/bin/env bash
# Install the project into a virtual environment (idempotent).
#   - creates the venv if missing;
#   - keeps an existing torch (e.g. a CUDA build on a GPU machine);
#   - otherwise installs torch 2.13.0: the CUDA build when an NVIDIA GPU is visible, else the CPU build
#     (set TORCH_INDEX_URL to PyTorch's CPU wheel index if your pip would fetch the CUDA build);
#   - installs the project in editable mode with the dev extras (pytest, ruff) and wandb (W&B logging);
#   - never installs Transformer Engine or apex on CPU (a partial TE install breaks `import megatron.core`).
set -euo pipefail
VENV=${1:-.venv}
BASE_PYTHON=${BASE_PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating $VENV"
  "$BASE_PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

if "$PY" -c "import torch" 2>/dev/null; then
  echo "[install] keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[install] NVIDIA GPU found: installing CUDA torch==$TORCH_VERSION"
  "${PIP[@]}" "torch==$TORCH_VERSION"
else
  echo "[install] no GPU: installing CPU torch==$TORCH_VERSION"
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
  else
    "${PIP[@]}" "torch==$TORCH_VERSION"
  fi
fi

echo "[install] installing the project (megatron-core==0.16.1 and friends)"
"${PIP[@]}" -e ".[dev,wandb]"
"$PY" -W ignore - <<'PY'
import megatron.core, torch
print(f"[install] ready: torch {torch.__version__} (cuda={torch.cuda.is_available()}), megatron-core {megatron.core.__version__}")
PY
touch "$VENV/.installed"
