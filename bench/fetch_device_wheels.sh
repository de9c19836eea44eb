#!/usr/bin/env bash
# Adds what the shared device kit lacks to .devicekit/wheels (run on the dev machine, which
# reaches PyPI; the H200 reaches nothing), for the H200's Python 3.12:
#   uvloop, httptools  the server's event loop and uvicorn's C parser (without them the server
#                      there runs on asyncio's own loop and uvicorn's pure-Python h11 parser);
#   pybind11           the C++ radix tree's build (without it the scheduler runs the Python tree);
#   xgrammar           constrained decoding (its other needs, pydantic, apache-tvm-ffi, torch,
#                      triton, transformers, are on the H200 or in the kit);
#   prometheus-client  the /metrics route;
#   jsonschema (+ its small dependencies)  the structured-output tests and bench;
#   sglang-router (+ what its launcher imports: aiohttp and its dependencies, orjson,
#                 setproctitle)  `serve --dp N` and run_h200.sh's dp_router stage.
# .devicekit/setup.sh installs every wheel in that folder.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .devicekit/wheels ] || { echo "copy the device kit to .devicekit/ first" >&2; exit 1; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --dest .devicekit/wheels \
    "uvloop>=0.19" "httptools>=0.6" "pybind11>=2.10" "xgrammar>=0.1.20" "prometheus-client>=0.20" \
    "jsonschema>=4" "jsonschema-specifications" "referencing" "rpds-py" "attrs" \
    "sglang-router>=0.3.2,<0.4" "aiohttp" "multidict" "yarl" "frozenlist" "aiosignal" \
    "propcache" "aiohappyeyeballs" "orjson" "setproctitle"
ls .devicekit/wheels | grep -E "^(uvloop|httptools|pybind11|xgrammar|prometheus|jsonschema|referencing|rpds|attrs|sglang_router|aiohttp|orjson|setproctitle)"
