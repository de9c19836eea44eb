#!/usr/bin/env bash
# Set up (if needed), lint, and run the whole test suite (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check .
ruff format --check .
exec python -m pytest -q "$@"
