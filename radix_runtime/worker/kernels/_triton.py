"""Triton when it is installed, else a stand-in that lets the kernel modules import.

Triton is the `gpu` extra. Without it the kernel modules still import, so their torch references
(and the CPU paths that use them) work everywhere; calling a Triton kernel then raises.
"""

from __future__ import annotations

import functools

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


# programmatic dependent launch (Hopper+): a kernel launched with it may start while the kernel
# before it finishes; it calls `gdc_wait` before touching anything that kernel writes
def _triton_has_pdl() -> bool:
    """Triton has the in-kernel wait (`gdc_wait`) and the launch option (`launch_pdl`)."""
    if not (HAVE_TRITON and hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


HAVE_PDL = _triton_has_pdl()


@functools.cache
def pdl_supported() -> bool:
    """Whether kernels on this process's GPU can use programmatic dependent launch: Triton with
    `gdc_wait` and a GPU of compute capability 9 or more."""
    import torch

    if not (HAVE_PDL and torch.cuda.is_available()):
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def pdl_launch(pdl: bool) -> dict:
    """The launch keywords of a kernel with a USE_PDL constexpr: `kernel[grid](..., **pdl_launch(p))`."""
    return {"USE_PDL": pdl, "launch_pdl": True} if pdl else {"USE_PDL": False}


if HAVE_TRITON:

    @triton.jit
    def pdl_wait(USE_PDL: tl.constexpr):
        """A dependently launched kernel's entry: wait until the kernel before it has finished
        (and its writes are visible), then let the next kernel launch (it waits in turn)."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

else:
    pdl_wait = None

__all__ = ["HAVE_PDL", "HAVE_TRITON", "pdl_launch", "pdl_supported", "pdl_wait", "tl", "triton"]
