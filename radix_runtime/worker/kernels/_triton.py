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

    @triton.jit
    def gemv_input(x_row, norm_ptr, col, ok, K, PROLOGUE: tl.constexpr):
        """A GEMV's fused input at columns `col` (float32) and x's square there (an RMSNorm's sum
        of squares): PROLOGUE 0 x, 1 x * norm (the norm's 1/rms scales the GEMV's result at the
        end), 2 silu(x[:K]) * x[K:], 3 gelu_tanh(x[:K]) * x[K:] (as g * sigmoid(2 y))."""
        if PROLOGUE >= 2:
            g = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(x_row + K + col, mask=ok, other=0.0).to(tl.float32)
            if PROLOGUE == 2:
                v = g / (1.0 + tl.exp(-g)) * up
            else:
                v = g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g))) * up
            return v, v
        v = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            return v * tl.load(norm_ptr + col, mask=ok, other=0.0).to(tl.float32), v * v
        return v, v

    @triton.jit
    def split_k_gather(part, p_off, p_ok, part_ptr, part_slab, aux, a_off, aux_ptr, aux_slab,
                       cnt_ptr, tile, split, SPLIT: tl.constexpr, AUX: tl.constexpr):  # fmt: skip
        """The end of a split-K program (one of SPLIT over the input dim of one output tile):
        store its partial `part` (at `p_off` of its split's slab of the float32 workspace
        `part_ptr`; slabs `part_slab` apart) and `aux` (AUX: e.g. its share of a norm's sum of
        squares, likewise), then count itself in at the tile's counter. The tile's last split
        to arrive gets (True, the SPLIT partials added in split order, the auxes likewise: the
        same bits every run, whichever split came last) and resets the counter to zero for the
        next call; the others get (False, zeros, zeros). `cnt_ptr` int32, zero between calls."""
        tl.store(part_ptr + split * part_slab + p_off, part, mask=p_ok)
        if AUX:
            tl.store(aux_ptr + split * aux_slab + a_off, aux)
        tl.debug_barrier()  # every thread's stores, then the counter's release
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        total = tl.zeros_like(part)
        total_aux = tl.zeros_like(aux)
        last = done == SPLIT - 1
        if last:  # the other splits' stores are visible (acquired); read them past L1
            for i in tl.static_range(SPLIT):
                total += tl.load(part_ptr + i * part_slab + p_off, mask=p_ok, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
                if AUX:
                    total_aux += tl.load(aux_ptr + i * aux_slab + a_off, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
        return last, total, total_aux

else:
    pdl_wait = split_k_gather = gemv_input = None

_COUNTERS: dict = {}


def split_counters(device, tiles: int):
    """The split-K tiles' arrival counters (`split_k_gather`): int32 zeros, one buffer per
    device shared by every split-K kernel (each call's last split of a tile resets its counter;
    the calls of a stream run one after another), grown when a call has more tiles."""
    import torch

    cnt = _COUNTERS.get(device)
    if cnt is None or cnt.numel() < tiles:
        cnt = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = cnt
    return cnt


__all__ = ["HAVE_PDL", "HAVE_TRITON", "gemv_input", "pdl_launch", "pdl_supported", "pdl_wait",
           "split_counters", "split_k_gather", "tl", "triton"]  # fmt: skip
