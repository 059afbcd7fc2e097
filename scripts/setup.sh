#!/usr/bin/env bash
# Create .venv and install flatserve with its dev extra (and the gpu extra where an NVIDIA
# GPU is visible). Where none is, the CPU build of torch goes in first so the project's
# torch range installs nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    .venv/bin/pip install -q "torch>=2.4,<3"
  else
    .venv/bin/pip install -q torch==2.13.0 \
      || .venv/bin/pip install -q "torch>=2.4,<3" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  .venv/bin/pip install -q -e ".[dev,gpu]"
else
  .venv/bin/pip install -q -e ".[dev]"
fi
