"""The C++ radix tree must be built wherever it can be: a failed build would otherwise turn the
differential tests of tests/unit/test_radix_cache_cpp.py into one "skipped" line of a green run.

Where a build is possible (a C++ compiler, the Python headers and pybind11 are present) or
required (`CI` or `RADIX_RUNTIME_REQUIRE_CPP` set), a missing extension fails here. A machine
without a compiler keeps the Python tree, with the scheduler's warning, and this test skips."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sysconfig
from pathlib import Path

import pytest


def build_prerequisites() -> list[str]:
    """What a build of csrc/ needs and this machine lacks (empty: it can build)."""
    missing = []
    compilers = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    if not any(c and shutil.which(c) for c in compilers):
        missing.append("a C++ compiler")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        missing.append("the Python headers (Python.h)")
    if importlib.util.find_spec("pybind11") is None:
        missing.append("pybind11")
    return missing


def build_required() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes")
        for v in ("CI", "RADIX_RUNTIME_REQUIRE_CPP")
    )


def test_the_cpp_radix_tree_is_built_where_it_can_be():
    missing = build_prerequisites()
    if missing and not build_required():
        pytest.skip(
            f"cannot build the C++ tree here (no {', '.join(missing)}): the Python tree serves"
        )
    try:
        from radix_runtime.scheduler import _radix_tree  # noqa: F401
        from radix_runtime.scheduler.allocator import PageAllocator
        from radix_runtime.scheduler.cache import make_radix_cache
    except ImportError as exc:
        pytest.fail(
            f"the C++ radix tree is not built ({exc}) although this machine can build it"
            f"{' (CI)' if build_required() else ''}: run `pip install -e .` or "
            "`python setup.py build_ext --inplace` and read the build's warning"
        )
    cache = make_radix_cache("auto", 1, PageAllocator(16))
    assert type(cache).__name__ == "CppRadixCache"  # what `--radix-tree-impl auto` picks
