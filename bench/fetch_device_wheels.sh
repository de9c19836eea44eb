#!/usr/bin/env bash
# Adds what the shared device kit lacks to .devicekit/wheels (run on the dev machine, which
# reaches PyPI; the H200 reaches nothing): uvloop and httptools, two of radix_runtime's own
# dependencies, for the H200's Python 3.12 (without them the server there runs on asyncio's
# own loop and uvicorn's pure-Python h11 parser), and pybind11, which the C++ radix tree's
# build needs (without it the scheduler there runs the Python tree: run_h200.sh's `build`).
# .devicekit/setup.sh installs every wheel in that folder.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .devicekit/wheels ] || { echo "copy the device kit to .devicekit/ first" >&2; exit 1; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --dest .devicekit/wheels "uvloop>=0.19" "httptools>=0.6" "pybind11>=2.10"
ls .devicekit/wheels | grep -E "^(uvloop|httptools|pybind11)-"
