#!/usr/bin/env bash
# Install the project into a virtual environment (idempotent).
#   scripts/install.sh [VENV]          MCORE=0.19.2 scripts/install.sh .venv-mcore-0.19.2
#   - creates the venv if missing;
#   - keeps an existing torch (e.g. a CUDA build on a GPU machine);
#   - otherwise installs torch 2.13.0: the CUDA build when an NVIDIA GPU is visible, else the CPU build
#     (set TORCH_INDEX_URL to PyTorch's CPU wheel index if your pip would fetch the CUDA build);
#   - megatron-core: MCORE=X installs exactly X. Without MCORE, an installed megatron-core inside the
#     supported range (>=0.16.1,<0.20: e.g. a container's) is kept; otherwise the newest supported release
#     this Python can use is installed (3.10/3.11: 0.16.1; >=3.12: 0.19.x). Releases >= 0.17 declare
#     Python >= 3.12: on an older Python they are installed with --ignore-requires-python (a test
#     configuration), their dependencies first and normally;
#   - triton for megatron-core >= 0.18 when missing (its schedules import it unconditionally);
#   - emerging-optimizers (Megatron-Core's Muon; with triton, which it imports); on 3.10/3.11 with
#     --ignore-requires-python and a .pth file adding typing.override (a marker, new in 3.12);
#   - installs the project in editable mode with the dev extras (pytest, ruff) and wandb (W&B logging);
#   - never installs Transformer Engine or apex on CPU (a partial TE install breaks `import megatron.core`).
set -euo pipefail
VENV=${1:-.venv}
BASE_PYTHON=${BASE_PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
MCORE=${MCORE:-}
SUPPORTED=">=0.16.1,<0.20"

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

# version_ge A B: A >= B (release numbers only)
version_ge() { "$PY" -c "import sys; from packaging.version import Version as V; sys.exit(0 if V('$1') >= V('$2') else 1)"; }
"$PY" -c "import packaging" 2>/dev/null || "${PIP[@]}" "packaging>=24.2"

INSTALLED=$("$PY" -c "from importlib import metadata as m; print(m.version('megatron-core'))" 2>/dev/null || true)
PY_MINOR=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ -n "$MCORE" ]; then
  WANT="$MCORE"
elif [ -n "$INSTALLED" ] && "$PY" -c "import sys; from packaging.specifiers import SpecifierSet; sys.exit(0 if '$INSTALLED' in SpecifierSet('$SUPPORTED') else 1)"; then
  WANT="$INSTALLED"
  echo "[install] keeping megatron-core $INSTALLED (inside the supported range $SUPPORTED)"
else
  if [ -n "$INSTALLED" ]; then
    echo "[install] WARNING: megatron-core $INSTALLED is outside the supported range $SUPPORTED; replacing it"
  fi
  if version_ge "$PY_MINOR" 3.12; then WANT="0.19"; else WANT="0.16.1"; fi
fi

if [ "$WANT" != "$INSTALLED" ]; then
  if [ "$WANT" = "0.19" ]; then SPEC="megatron-core>=0.19,<0.20"; else SPEC="megatron-core==$WANT"; fi
  if version_ge "${WANT}" 0.17 && ! version_ge "$PY_MINOR" 3.12; then
    echo "[install] $SPEC declares Python >= 3.12; installing it on Python $PY_MINOR with --ignore-requires-python (test configuration)"
    "${PIP[@]}" numpy "packaging>=24.2"
    "${PIP[@]}" --no-deps --ignore-requires-python "$SPEC"
  else
    echo "[install] installing $SPEC"
    "${PIP[@]}" "$SPEC"
  fi
fi
MCORE_NOW=$("$PY" -c "from importlib import metadata as m; print(m.version('megatron-core'))")
if version_ge "$MCORE_NOW" 0.18 && ! "$PY" -c "import triton" 2>/dev/null; then
  echo "[install] megatron-core $MCORE_NOW imports triton: installing it"
  "${PIP[@]}" triton
fi

# emerging-optimizers: Megatron-Core's Muon (optimizer.name=muon) is built on it; its Muon module imports triton
# (a dependency of CUDA torch, not of the CPU build). It declares Python >= 3.12 and uses typing.override (3.12):
# on 3.10/3.11 (test configuration) its dependencies first and normally, then it with --ignore-requires-python, and
# a .pth file that adds typing.override (a marker) at start-up (megatron-core 0.19 imports the package with
# `import megatron.core`).
if ! "$PY" -c "import triton" 2>/dev/null; then
  echo "[install] emerging-optimizers (Muon) imports triton: installing it"
  "${PIP[@]}" triton
fi
if version_ge "$PY_MINOR" 3.12; then
  "${PIP[@]}" "emerging-optimizers>=0.3"
else
  echo "[install] emerging-optimizers declares Python >= 3.12; installing it on Python $PY_MINOR with --ignore-requires-python (test configuration)"
  "${PIP[@]}" absl-py
  "${PIP[@]}" --no-deps --ignore-requires-python "emerging-optimizers>=0.3"
  SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  # typing.override only marks a method (3.12 sets __override__); before 3.12 it is the identity
  echo 'import typing; typing.override = getattr(typing, "override", None) or (lambda method: method)' \
    > "$SITE/emerging_optimizers_typing_override.pth"
fi

echo "[install] installing the project (megatron-core$SUPPORTED and friends)"
"${PIP[@]}" -e ".[dev,wandb]"
MCORE_AFTER=$("$PY" -c "from importlib import metadata as m; print(m.version('megatron-core'))")
if [ "$MCORE_AFTER" != "$MCORE_NOW" ]; then
  echo "[install] error: installing the project replaced megatron-core $MCORE_NOW by $MCORE_AFTER" >&2
  exit 1
fi
NO_VCS_VERSION=1 "$PY" -W ignore - <<'PY'
import megatron.core, torch
print(f"[install] ready: torch {torch.__version__} (cuda={torch.cuda.is_available()}), megatron-core {megatron.core.__version__}")
PY
touch "$VENV/.installed"
