"""Triton when it is installed, else a stand-in that lets the kernel modules import.

Triton is the `gpu` extra. Without it the kernel modules still import, so their torch references
(and the CPU paths that use them) work everywhere; calling a Triton kernel then raises.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

    class _Unavailable:
        def __init__(self, fn) -> None:
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid):
            raise RuntimeError(f"{self.__name__} is a Triton kernel and Triton is not installed")

    class _TritonStandIn:
        """`triton.jit` and the two host helpers the kernel wrappers call."""

        @staticmethod
        def jit(fn=None, **_):
            return _Unavailable(fn) if fn is not None else _Unavailable

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (n - 1).bit_length()

    triton = _TritonStandIn()
    tl = None

__all__ = ["HAVE_TRITON", "tl", "triton"]
