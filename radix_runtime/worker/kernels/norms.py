"""RMSNorms of the CUDA path: FlashInfer's precompiled RMSNorm and fused add + RMSNorm, Gemma's
(1 + w) norm (FlashInfer's, torch without it), and Gemma's sublayer-exit norm + residual add +
next norm in one Triton kernel; each with its torch reference."""

from __future__ import annotations

import torch

from radix_runtime.worker.kernels._triton import pdl_launch, pdl_wait, tl, triton

try:
    from flashinfer.norm import fused_add_rmsnorm as _fi_fused_add_rmsnorm
    from flashinfer.norm import rmsnorm as _fi_rmsnorm
except ImportError:  # kernels.available() says False
    _fi_fused_add_rmsnorm = _fi_rmsnorm = None
try:
    from flashinfer.norm import gemma_rmsnorm as _fi_gemma_rmsnorm
except ImportError:
    _fi_gemma_rmsnorm = None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _fi_rmsnorm(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x; x = rmsnorm(residual) * weight, both in place; returns x."""
    _fi_fused_add_rmsnorm(x, residual, weight, eps)
    return x


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference, rounded once (as the kernels compute)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float()).to(x.dtype)


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _fi_gemma_rmsnorm is None:
        return gemma_rmsnorm_torch(x, weight, eps)
    return _fi_gemma_rmsnorm(x, weight, eps)


def gemma_rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


@triton.jit
def _gemma_norm_add_norm_kernel(
    h_ptr,
    res_ptr,
    out_ptr,
    w_post_ptr,
    w_next_ptr,
    eps,
    HIDDEN,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    h = tl.load(h_ptr + row * HIDDEN + cols, mask=ok, other=0.0).to(tl.float32)
    w_post = tl.load(w_post_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    w_next = tl.load(w_next_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    normed = h * tl.rsqrt(tl.sum(h * h, axis=0) / HIDDEN + eps) * (1.0 + w_post)
    # the residual stream is kept in the model dtype, as the unfused path rounds it
    normed = normed.to(res_ptr.dtype.element_ty).to(tl.float32)
    r = tl.load(res_ptr + row * HIDDEN + cols, mask=ok, other=0.0).to(tl.float32) + normed
    r = r.to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * HIDDEN + cols, r, mask=ok)
    r = r.to(tl.float32)
    x = r * tl.rsqrt(tl.sum(r * r, axis=0) / HIDDEN + eps) * (1.0 + w_next)
    tl.store(out_ptr + row * HIDDEN + cols, x.to(out_ptr.dtype.element_ty), mask=ok)


def gemma_norm_add_norm(
    h: torch.Tensor,
    residual: torch.Tensor,
    w_post: torch.Tensor,
    w_next: torch.Tensor,
    eps: float,
    pdl: bool = False,
) -> torch.Tensor:
    """Gemma's sublayer exit and the next entry in one kernel: residual += gemma_norm(h, w_post)
    (in place); returns gemma_norm(residual, w_next). `pdl`: launch dependently."""
    if not (h.is_contiguous() and residual.is_contiguous()):
        return gemma_norm_add_norm_torch(h, residual, w_post, w_next, eps)
    rows, hidden = h.shape
    out = torch.empty_like(h)
    if rows:
        _gemma_norm_add_norm_kernel[(rows,)](
            h, residual, out, w_post, w_next, eps, hidden,
            BLOCK=triton.next_power_of_2(hidden), num_warps=8, **pdl_launch(pdl),
        )  # fmt: skip
    return out


def gemma_norm_add_norm_torch(
    h: torch.Tensor,
    residual: torch.Tensor,
    w_post: torch.Tensor,
    w_next: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The reference (two norms and an add, as the unfused layers compute them)."""
    residual.add_(gemma_rmsnorm_torch(h, w_post, eps))
    return gemma_rmsnorm_torch(residual, w_next, eps)
