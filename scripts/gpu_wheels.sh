#!/usr/bin/env bash
# The wheels a bare GPU machine (torch, Triton and transformers' own dependencies there, no
# package registry) lacks to run scripts/gpu_checks.sh, into ./.whl (ignored by git; name it
# in the device tool's `carry`). Run here, where the registry is reachable, before a lease:
#
#     GPU_PYTHON=3.12 bash scripts/gpu_wheels.sh      # the GPU machine's Python version
#
# What was missing there (../shared/research/gpu.md): the API's packages, PyAV, transformers
# at the project's version, and for Qwen3.5's kernels fla-core (1 MB) with einops. Their
# sizes are printed: the device tool carries 64 MiB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=${GPU_PYTHON:-3.12}
TRANSFORMERS=$("$PY" -c "from importlib.metadata import version; print(version('transformers'))")
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --dest .whl \
    --python-version "$VERSION" --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 \
    pyzmq fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn \
    httptools pybase64 setproctitle av "transformers==$TRANSFORMERS" opentelemetry-api \
    fla-core einops
du -ch .whl/*.whl | tail -1
