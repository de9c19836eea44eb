#!/usr/bin/env bash
# Set up (if needed) and serve the embedded default model on http://127.0.0.1:30000
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/radix-runtime serve "$@"
