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
