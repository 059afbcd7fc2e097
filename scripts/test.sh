#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite plus lint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
