"""Picks the radix tree implementation: the C++ one when built (and asked for), else Python."""

from __future__ import annotations

import logging

from radix_runtime.scheduler.allocator import PageAllocator
from radix_runtime.scheduler.radix_cache import RadixCache

logger = logging.getLogger(__name__)


def make_radix_cache(impl: str, page_size: int, allocator: PageAllocator, disable: bool = False):
    if impl not in ("auto", "python", "cpp"):
        raise ValueError(f"unknown radix tree implementation {impl!r}")
    if impl in ("auto", "cpp"):
        try:
            from radix_runtime.scheduler.radix_cache_cpp import CppRadixCache
        except ImportError as exc:
            if impl == "cpp":
                raise RuntimeError(
                    f"--radix-tree-impl cpp: the C++ extension is not built ({exc})"
                ) from exc
            logger.warning(
                "the C++ radix tree is not built (%s); using the Python tree (build it with "
                "`pip install -e .` or `python setup.py build_ext --inplace`)",
                exc,
            )
        else:
            return CppRadixCache(page_size, allocator, disable=disable)
    return RadixCache(page_size, allocator, disable=disable)
