"""Dynamic per-token FP8 quantization of activations (the input of an FP8 projection on tensor
cores) in one Triton kernel, and the torch reference (which the CPU path runs)."""

from __future__ import annotations

import torch

from radix_runtime.worker.kernels._triton import tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@triton.jit
def _quantize_rows_fp8_kernel(x_ptr, q_ptr, s_ptr, K, x_stride, BLOCK: tl.constexpr):
    # one program per row: scale = max|x| / 448, q = x / scale in e4m3 (one read of x)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + r * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(q_ptr + r * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + r, scale)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (e4m3 [M, K], float32 scales [M, 1]): the dynamic per-token
    activation quantization of an FP8 projection in one kernel (torch's is six)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quantize_rows_fp8_kernel[(m,)](x, q, s, k, x.stride(0), BLOCK=block,
                                        num_warps=8 if block >= 4096 else 4)  # fmt: skip
    return q, s


def quantize_rows_fp8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: [M, K] activations -> (e4m3 [M, K], float32 scale [M, 1])."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=1e-12)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale
