"""Picks the radix tree implementation: the C++ one when built (and asked for), else Python."""

from __future__ import annotations

import logging

from radix_runtime.scheduler.allocator import PageAllocator
from radix_runtime.scheduler.radix_cache import RadixCache

logger = logging.getLogger(__name__)


def make_radix_cache(
    impl: str,
    page_size: int,
    allocator: PageAllocator,
    disable: bool = False,
    host_allocator: PageAllocator | None = None,
    write_through: bool = False,
):
    """`host_allocator`: the host tier's pool (--enable-hierarchical-cache); both trees have
    the host tier (docs/hicache.md)."""
    if impl not in ("auto", "python", "cpp"):
        raise ValueError(f"unknown radix tree implementation {impl!r}")
    if host_allocator is not None:
        logger.info(
            "host KV tier: %d host pages, %s",
            host_allocator.total_pages,
            "write_through" if write_through else "write_back",
        )
    tier = dict(host_allocator=host_allocator, write_through=write_through)
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
            return CppRadixCache(page_size, allocator, disable=disable, **tier)
    return RadixCache(page_size, allocator, disable=disable, **tier)
