#!/usr/bin/env bash
# Set up (idempotent) and serve the OpenAI-compatible API on the tiny default model.
# Extra arguments go to `flatserve serve` (e.g. --model /path/to/Qwen2.5-VL --port 8001).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/flatserve serve "$@"
