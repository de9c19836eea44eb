"""Host -> device copies that never wait for the device.

A plain `.to(cuda)`, `torch.tensor(..., device=cuda)` or a copy from pageable host memory blocks
the host until the stream has drained. With the overlap schedule the host prepares step N+1 while
the device runs step N, so every upload on that path goes through pinned memory with
`non_blocking=True`: the copy is queued in stream order, and PyTorch's caching host allocator
keeps the pinned block alive until the copy has run. Off CUDA both are plain copies.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list / array / tensor as a new `dtype` tensor on `device`."""
    if isinstance(values, torch.Tensor):
        t = values
    else:
        a = np.asarray(values)
        t = torch.from_numpy(a) if a.flags.writeable else torch.tensor(a)
    t = t.to(dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def upload(dst: torch.Tensor, host: np.ndarray) -> None:
    """Copy a host array into an existing buffer (a CUDA graph's or an attention plan's)."""
    src = torch.from_numpy(np.ascontiguousarray(host))
    if dst.is_cuda:
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)


# -- strided host -> device copies (the host tier's layer-by-layer loads) ----------------------

_memcpy_2d = None  # cudaMemcpy2DAsync of the CUDA runtime, or False where there is none
_CUDA_MEMCPY_HOST_TO_DEVICE = 1


def memcpy_2d_available() -> bool:
    """Whether `memcpy_2d` can run: the CUDA runtime's cudaMemcpy2DAsync through ctypes (torch
    exposes no strided host-to-device copy: its copy of a strided pinned tensor first makes it
    contiguous in pageable memory, synchronously)."""
    global _memcpy_2d
    if _memcpy_2d is None:
        _memcpy_2d = _load_memcpy_2d() or False
    return bool(_memcpy_2d)


def memcpy_2d(
    dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int, stream: int
) -> None:
    """Queue `rows` rows of `width` bytes from host address `src` (rows `src_pitch` apart, in
    pinned memory) to device address `dst` (rows `dst_pitch` apart) on `stream` (a CUDA stream
    handle): one DMA of a strided block, never waiting for the device."""
    if not memcpy_2d_available():
        raise RuntimeError("cudaMemcpy2DAsync is not available (no CUDA runtime library found)")
    err = _memcpy_2d(
        dst, dst_pitch, src, src_pitch, width, rows, _CUDA_MEMCPY_HOST_TO_DEVICE, stream
    )
    if err != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed (CUDA error {err})")


def _cudart_candidates() -> list[str]:
    """The CUDA runtime library this process has loaded (torch's), then the usual names."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if "libcudart.so" in path and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]


def _load_memcpy_2d():
    import ctypes

    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # torch's runtime loaded and its context current first
    for name in _cudart_candidates():
        try:
            lib = ctypes.CDLL(name)
            fn = lib.cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        size, ptr = ctypes.c_size_t, ctypes.c_void_p
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, size, ptr, size, size, size, ctypes.c_int, ptr]
        # the same device as torch's (a second copy of the runtime starts on device 0)
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaSetDevice(torch.cuda.current_device())
        return fn
    return None
