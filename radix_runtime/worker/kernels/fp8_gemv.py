"""W8A8 GEMV on FP8 tensor cores: a few input rows (batch-1 decode, small batches) times FP8 weights
with one float32 scale per output row, the bf16 GEMV's fused prologues and epilogue kept, and the
torch reference.

The W8A16 GEMV (kernels/gemv.py with `w_scale`) widens every weight to float32 in registers
before its FMA; at the 8B shapes that conversion, not the bytes, bounds it (2.3-3.2 TB/s,
docs/quantization.md). Here the weight tile goes to the tensor cores as it is in memory: the
input row is quantized to e4m3 with a dynamic per-row scale (max |x| / 448, as
kernels/fp8_quant.py's `quantize_rows_fp8` for the many-rows path) and `tl.dot` multiplies a
[BLOCK_M, BLOCK_K] FP8 tile of inputs (one real row at batch 1, the others broadcast copies) by the
weight's [BLOCK_K, BLOCK_N] tile, accumulating in float32; the epilogue applies the input's scale
times each row's weight scale. The K loop is software-pipelined by Triton (`num_stages` tiles
in flight through shared memory), which is what keeps the weight stream going.

The input's per-row scale needs the whole row before the first product, so every program first
walks its input row once (max |f(x)|, and the RMSNorm's sum of squares), then quantizes each
block again as it multiplies it: f(x) is x, x * norm (the norm's 1/rms scales the result at
the end, as in gemv.py) or silu(x[:K]) * x[K:]. Each program owns BLOCK_N whole output rows (no
split-K, no atomics: the same bits every run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radix_runtime.worker.kernels._triton import pdl_launch, tl, triton
from radix_runtime.worker.kernels.activation import gelu_tanh_and_mul_torch, silu_and_mul_torch
from radix_runtime.worker.kernels.fp8_quant import quantize_rows_fp8_torch

# the prologues (gemv.py's GEMV_* numbers)
FP8_MMA_PLAIN, FP8_MMA_NORM, FP8_MMA_SILU, FP8_MMA_GELU = 0, 1, 2, 3
FP8_MMA_MAX_ROWS = 16  # input rows of one call: one tensor-core tile of rows
# (BLOCK_N, BLOCK_K, num_warps, num_stages, swap) per (rows, cols, prologue, add), measured on
# the H200 by bench/quant.py's fp8_mma sweep (docs/results/h200_quant_fp8_mma.json, us per
# product); other keys get FP8_MMA_DEFAULT_CONFIG
FP8_MMA_DEFAULT_CONFIG = (128, 256, 4, 3, 1)
FP8_MMA_CONFIGS: dict[tuple[int, int, int, bool], tuple[int, int, int, int, int]] = {
    (28672, 4096, FP8_MMA_NORM, False): (128, 256, 4, 3, 1),  # Llama-3.1-8B gate_up 33.8
    (128256, 4096, FP8_MMA_PLAIN, False): (64, 512, 4, 3, 1),  # its LM head (FP8) 126.4
}


@triton.jit
def _input_block(x_row, norm_ptr, col, ok, K, PROLOGUE: tl.constexpr):
    """f(x) at columns `col` (float32) and x's square there (the RMSNorm's sum of squares)."""
    if PROLOGUE >= 2:  # gated: act(x[:K]) * x[K:] (SiLU, or GELU-tanh as g * sigmoid(2 y))
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
def _mma_step(acc, w, x_ptr, x_rows, norm_ptr, col, k_ok, m_ok, x_scale, K,
              PROLOGUE: tl.constexpr, ONE_ROW: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_K: tl.constexpr, SWAP: tl.constexpr):  # fmt: skip
    """acc += the weight block `w` times the input block at columns `col`, quantized to e4m3."""
    if ONE_ROW:
        v, _ = _input_block(x_ptr, norm_ptr, col, k_ok, K, PROLOGUE)
        q = tl.clamp(v / x_scale, -448.0, 448.0).to(w.dtype)
        xq = tl.broadcast_to(q[None, :], (BLOCK_M, BLOCK_K))
    else:
        ok = m_ok[:, None] & k_ok[None, :]
        v, _ = _input_block(x_rows, norm_ptr, col[None, :], ok, K, PROLOGUE)
        xq = tl.clamp(v / x_scale[:, None], -448.0, 448.0).to(w.dtype)
    if SWAP:  # (one return: Triton types every return of a function alike)
        acc = tl.dot(w, tl.trans(xq), acc)
    else:
        acc = tl.dot(xq, tl.trans(w), acc)
    return acc


@triton.jit
def _fp8_mma_gemv_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    y_ptr,
    norm_ptr,
    M,
    N,
    K,
    x_stride,
    y_stride,
    eps,
    PROLOGUE: tl.constexpr,  # 0 x | 1 rmsnorm(x) * norm | 2 silu(x[:K]) * x[K:] | 3 gelu_tanh
    ADD: tl.constexpr,  # y += W . f(x) (the residual stream) instead of y = W . f(x)
    ONE_ROW: tl.constexpr,  # M == 1: the row is made once and broadcast to the tile's rows
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_X: tl.constexpr,  # the first pass's step along the input (few steps: few round trips)
    SWAP: tl.constexpr,  # weights as the dot's first operand: [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]
    USE_PDL: tl.constexpr,  # launched dependently: the first weight block loads before the wait,
    # and the next kernel launches only once the weight stream is done (its programs, waiting
    # early, would hold the SM slots this kernel's later programs need)
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk0 = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    w_ok = n_ok[:, None] & (rk0 < K)[None, :]
    if USE_PDL:  # weights are never written by a kernel: their loads need not wait
        w0 = tl.load(w_rows + rk0[None, :], mask=w_ok, other=0.0)
        tl.extra.cuda.gdc_wait()  # (kernels/_triton.py's pdl_wait, without launching the next)
    # pass 1: each input row's max |f(x)| (its FP8 scale) and sum of squares
    rx = tl.arange(0, BLOCK_X)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * x_stride
    if ONE_ROW:
        amax_v = tl.zeros((BLOCK_X,), dtype=tl.float32)
        sq_v = tl.zeros((BLOCK_X,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_X):
            col = k0 + rx
            v, s = _input_block(x_ptr, norm_ptr, col, col < K, K, PROLOGUE)
            amax_v = tl.maximum(amax_v, tl.abs(v))
            sq_v += s
        amax = tl.max(amax_v, axis=0)
        sq = tl.sum(sq_v, axis=0)
    else:
        amax_t = tl.zeros((BLOCK_M, BLOCK_X), dtype=tl.float32)
        sq_t = tl.zeros((BLOCK_M, BLOCK_X), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_X):
            col = k0 + rx
            ok = m_ok[:, None] & (col < K)[None, :]
            v, s = _input_block(x_rows, norm_ptr, col[None, :], ok, K, PROLOGUE)
            amax_t = tl.maximum(amax_t, tl.abs(v))
            sq_t += s
        amax = tl.max(amax_t, axis=1)  # [BLOCK_M]
        sq = tl.sum(sq_t, axis=1)
    x_scale = tl.maximum(amax / 448.0, 1e-12)
    if ADD:  # fetched before the weight stream: its latency hides behind it
        y_off = rm.to(tl.int64)[:, None] * y_stride + rn[None, :]
        y0 = tl.load(y_ptr + y_off, mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # pass 2: the weight stream, each input block quantized again as it is multiplied
    k_start = 0
    if USE_PDL:
        acc = _mma_step(acc, w0, x_ptr, x_rows, norm_ptr, rk0, rk0 < K, m_ok, x_scale, K,
                        PROLOGUE, ONE_ROW, BLOCK_M, BLOCK_K, SWAP)  # fmt: skip
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        col = k0 + rk0
        k_ok = col < K
        w = tl.load(w_rows + col[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _mma_step(acc, w, x_ptr, x_rows, norm_ptr, col, k_ok, m_ok, x_scale, K,
                        PROLOGUE, ONE_ROW, BLOCK_M, BLOCK_K, SWAP)  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if SWAP:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    row_scale = x_scale
    if PROLOGUE == 1:
        row_scale = row_scale * tl.rsqrt(sq / K + eps)
    w_scale = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    if ONE_ROW:
        y = acc * (row_scale * w_scale)[None, :]
    else:
        y = acc * row_scale[:, None] * w_scale[None, :]
    if ADD:
        y += y0
    else:
        y_off = rm.to(tl.int64)[:, None] * y_stride + rn[None, :]
    tl.store(y_ptr + y_off, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_mma_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu: bool = False,
    gelu: bool = False,
    add_to: torch.Tensor | None = None,
    config: tuple[int, ...] | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x [M, K] (M <= 16, rows contiguous) -> f(x) W^T [M, N] in x's dtype, W e4m3 [N, K]
    contiguous with `w_scale` float32 [N]; f(x) quantized to e4m3 per row (W8A8). f is x,
    rmsnorm(x) * norm_weight (`norm_weight`), silu(x[:, :K]) * x[:, K:] (`silu`, x [M, 2K]) or
    gelu_tanh(x[:, :K]) * x[:, K:] (`gelu`); with `add_to` ([M, N]) the product is added into it
    in place (returned). `config` (BLOCK_N, BLOCK_K, num_warps, num_stages, swap) overrides
    FP8_MMA_CONFIGS / the default (swap 1: the weight tile is the dot's first operand, BLOCK_N
    >= 64). `pdl`: launch dependently."""
    m = x.shape[0]
    n, k = weight.shape
    if not 1 <= m <= FP8_MMA_MAX_ROWS:
        raise ValueError(f"fp8_mma_gemv: {m} input rows (1 to {FP8_MMA_MAX_ROWS})")
    gated = silu or gelu
    if (silu and gelu) or (gated and norm_weight is not None):
        raise ValueError("fp8_mma_gemv: one prologue at a time (norm, SiLU or GELU)")
    if x.shape[1] != (2 * k if gated else k) or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"fp8_mma_gemv: input {tuple(x.shape)} for a weight {tuple(weight.shape)}")
    if w_scale.numel() != n:
        raise ValueError(f"fp8_mma_gemv: {w_scale.numel()} weight scales for {n} rows")
    prologue = (
        FP8_MMA_SILU if silu else FP8_MMA_GELU if gelu else FP8_MMA_NORM
        if norm_weight is not None else FP8_MMA_PLAIN
    )  # fmt: skip
    if add_to is None:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        if add_to.shape != (m, n) or add_to.stride(1) != 1:
            raise ValueError(f"fp8_mma_gemv: add_to must be a [{m}, {n}] tensor with unit stride")
        y = add_to
    key = (n, k, prologue, add_to is not None)
    m_block = 1 if m == 1 else 16  # the first pass holds BLOCK_X inputs of each of its rows
    block_n, block_k, warps, stages, swap = config or FP8_MMA_CONFIGS.get(
        key, FP8_MMA_DEFAULT_CONFIG
    )
    _fp8_mma_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, w_scale, y, x if norm_weight is None else norm_weight, m, n, k, x.stride(0),
        y.stride(0), eps, PROLOGUE=prologue, ADD=add_to is not None, ONE_ROW=m == 1, BLOCK_M=16,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_X=min(triton.next_power_of_2(k), 4096 // m_block),
        SWAP=bool(swap), num_warps=warps, num_stages=stages,
        **pdl_launch(pdl),
    )  # fmt: skip
    return y


def fp8_mma_gemv_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu: bool = False,
    gelu: bool = False,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference for `fp8_mma_gemv`, in float32: f(x) (before the norm's 1/rms) rounded to
    e4m3 per row by kernels/fp8_quant.py's reference, times the dequantized weight."""
    xf = x.float()
    r = None
    if silu or gelu:
        xf = (silu_and_mul_torch if silu else gelu_tanh_and_mul_torch)(xf)
    elif norm_weight is not None:
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xf = xf * norm_weight.float()
    xq, xs = quantize_rows_fp8_torch(xf)
    y = F.linear(xq.float(), weight.float()) * (xs * w_scale.float()[None, :])
    if r is not None:
        y = y * r
    if add_to is None:
        return y.to(x.dtype)
    add_to.copy_((add_to.float() + y).to(add_to.dtype))
    return add_to
