"""Gated-MLP activations: SiLU-and-mul (Triton for few rows, FlashInfer's for many) and
gelu(tanh)-and-mul (Triton: FlashInfer's gelu kernel is not in the precompiled set, it would
compile on first use), each with its torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radix_runtime.worker.kernels._triton import tl, triton

try:
    from flashinfer.activation import silu_and_mul as _fi_silu_and_mul
except ImportError:  # kernels.available() says False
    _fi_silu_and_mul = None

# SiLU-and-mul: Triton for few rows (FlashInfer's kernel gives one block per row, which leaves
# the GPU idle at batch 1), FlashInfer's for many
TRITON_SILU_MAX_ROWS = 64


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, INTER, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    gate = tl.load(x_ptr + row * 2 * INTER + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * INTER + INTER + cols, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + row * INTER + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def _gated(kernel, x: torch.Tensor) -> torch.Tensor:
    """Launch a gated-activation kernel over contiguous x [N, 2I] (gate | up) -> [N, I]."""
    rows, inter = x.shape[0], x.shape[1] // 2
    y = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows:
        block = 1024
        kernel[(rows, triton.cdiv(inter, block))](x, y, inter, BLOCK=block)
    return y


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return _gated(_silu_and_mul_kernel, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> silu(gate) * up, [N, I]."""
    if x.shape[0] <= TRITON_SILU_MAX_ROWS and x.is_contiguous():
        return silu_and_mul_triton(x)
    return _fi_silu_and_mul(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, y_ptr, INTER, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    gate = tl.load(x_ptr + row * 2 * INTER + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * INTER + INTER + cols, mask=ok, other=0.0).to(tl.float32)
    # 0.5 x (1 + tanh(y)) = x * sigmoid(2 y), y = sqrt(2 / pi) (x + 0.044715 x^3)
    y2 = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
    out = gate / (1.0 + tl.exp(-y2)) * up
    tl.store(y_ptr + row * INTER + cols, out.to(y_ptr.dtype.element_ty), mask=ok)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> gelu_tanh(gate) * up, [N, I]."""
    if not x.is_contiguous():
        return gelu_tanh_and_mul_torch(x)
    return _gated(_gelu_tanh_and_mul_kernel, x)


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
