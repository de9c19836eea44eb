"""W4A16: packed int4 weights dequantized in registers, a GEMV for decode rows and a GEMM for
many rows, and the torch reference.

The layout (what worker/quant.py's `Int4Linear` holds, repacked at load from AWQ's or GPTQ's):
- `qweight` int32 [N, K/8]: nibble i (bits 4i..4i+3) of word j holds q[n, 8j + i], 0..15, so a
  weight row is contiguous along the reduction dim (a GEMV streams it);
- `scales` float32 [N, ceil(K/G)] and `zeros` uint8 [N, ceil(K/G)] per group of G input columns
  (G a multiple of 8);
- w[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G].

The kernel never forms w: per packed word it takes the 8 products q * x (each nibble shifted out
of the word in registers) and the 8 inputs' sum, and adds scale * (sum(q * x) - zero * sum(x))
(the zero point folded out of the inner loop).
Each program owns BLOCK_N whole rows of one input row (no split-K, no atomics: the same bits every
run); the input rows of a small batch are the grid's fastest axis, so the programs that read the
same weight rows run together and share them through L2.

Numerics: float32 throughout, rounded once; the reference dequantizes to float32 and multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radix_runtime.worker.kernels._triton import tl, triton

# (BLOCK_N rows, BLOCK_KW packed words = 8 * BLOCK_KW input columns, num_warps)
INT4_GEMV_DEFAULT_CONFIG = (8, 128, 4)


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    N,
    K,
    groups,
    x_stride,
    y_stride,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)  # the input row (fastest: the weight rows stay in L2)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rn < N
    rows = rn.to(tl.int64)
    kw_total = K // 8
    x_row = x_ptr + m * x_stride
    acc = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    for kw0 in range(0, kw_total, BLOCK_KW):
        jw = kw0 + tl.arange(0, BLOCK_KW)  # packed word index along K
        w_ok = jw < kw_total
        ok = row_ok[:, None] & w_ok[None, :]
        words = tl.load(qw_ptr + rows[:, None] * kw_total + jw[None, :], mask=ok, other=0,
                        eviction_policy="evict_first")  # fmt: skip
        # per word: sum over its 8 nibbles of q * x, and of x (each nibble from the word in
        # registers: shift and mask, no layout change)
        qx = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
        xs = tl.zeros((BLOCK_KW,), dtype=tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_row + jw * 8 + i, mask=w_ok, other=0.0).to(tl.float32)
            qx += ((words >> (4 * i)) & 0xF).to(tl.float32) * xi[None, :]
            xs += xi
        sz = rows[:, None] * groups + ((jw * 8) // GROUP)[None, :]
        s = tl.load(s_ptr + sz, mask=ok, other=0.0)
        z = tl.load(z_ptr + sz, mask=ok, other=0).to(tl.float32)
        acc += s * (qx - z * xs[None, :])
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + m * y_stride + rn, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def _operands(
    name: str,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 kernels' operand checks: x with unit column stride and the output y [M, N]."""
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape != (n, k // 8) or k % 8 or group_size % 8:
        raise ValueError(
            f"{name}: input of {k} columns, qweight {tuple(qweight.shape)}, group {group_size}"
        )
    if scales.shape != (n, -(-k // group_size)) or zeros.shape != scales.shape:
        raise ValueError(f"{name}: scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, torch.empty((m, n), dtype=x.dtype, device=x.device)


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] (rows contiguous; a few rows: decode) -> x W^T [M, N] in x's dtype, W given in the
    layout above. `config` (BLOCK_N, BLOCK_KW, num_warps) overrides INT4_GEMV_DEFAULT_CONFIG."""
    x, y = _operands("int4_gemv", x, qweight, scales, zeros, group_size)
    (m, k), n = x.shape, y.shape[1]
    if m == 0:
        return y
    block_n, block_kw, warps = config or INT4_GEMV_DEFAULT_CONFIG
    _int4_gemv_kernel[(m, triton.cdiv(n, block_n))](
        x, qweight, scales, zeros, y, n, k, scales.shape[1], x.stride(0), y.stride(0),
        GROUP=group_size, BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=warps,
    )  # fmt: skip
    return y


# ---------------------------------------------------------------------------------------------
# many rows (prefill, larger decode batches): a GEMM on tensor cores
#
# The 8 nibbles of a packed word are 8 columns of W spaced one apart; taking nibble i of every
# word of a tile gives W's columns 8j + i, a [BLOCK_N, BLOCK_KW] tile that multiplies x's columns
# 8j + i. So a K step is 8 tensor-core products of depth BLOCK_KW, each of a tile dequantized in
# registers and rounded to x's dtype (as the dequantized path rounds W), without forming W.


def int4_gemm_config(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_KW, num_warps, num_stages) for `m` rows: tiles that compile for
    sm_90 without register spills (ptxas -v), small M blocks for decode batches (each weight
    tile read once for all rows), large ones for long inputs. Not tuned on the GPU yet."""
    if m <= 16:
        return (16, 64, 16, 4, 2)
    if m <= 32:
        return (32, 64, 16, 4, 2)
    if m <= 128:
        return (64, 64, 16, 4, 2)
    return (128, 128, 16, 8, 3)


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    groups,
    x_stride,
    y_stride,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * x_stride
    w_rows = rn.to(tl.int64)[:, None]
    kw_total = K // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kw0 in range(0, kw_total, BLOCK_KW):
        jw = kw0 + tl.arange(0, BLOCK_KW)
        w_ok = jw < kw_total
        ok = n_ok[:, None] & w_ok[None, :]
        words = tl.load(qw_ptr + w_rows * kw_total + jw[None, :], mask=ok, other=0)
        sz = w_rows * groups + ((jw * 8) // GROUP)[None, :]
        s = tl.load(s_ptr + sz, mask=ok, other=0.0)
        z = tl.load(z_ptr + sz, mask=ok, other=0).to(tl.float32)
        for i in tl.static_range(8):
            xi = tl.load(x_rows + (jw * 8 + i)[None, :], mask=m_ok[:, None] & w_ok[None, :],
                         other=0.0)  # fmt: skip
            wi = ((((words >> (4 * i)) & 0xF).to(tl.float32) - z) * s).to(xi.dtype)
            acc = tl.dot(xi, tl.trans(wi), acc)
    out = y_ptr + rm.to(tl.int64)[:, None] * y_stride + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """`int4_gemv` for many rows, on tensor cores: W's tiles are dequantized in registers and
    rounded to x's dtype (bf16 / fp16). `config` (BLOCK_M, BLOCK_N, BLOCK_KW, num_warps,
    num_stages) overrides `int4_gemm_config(M)`."""
    x, y = _operands("int4_gemm", x, qweight, scales, zeros, group_size)
    (m, k), n = x.shape, y.shape[1]
    if m == 0:
        return y
    block_m, block_n, block_kw, warps, stages = config or int4_gemm_config(m)
    _int4_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, qweight, scales, zeros, y, m, n, k, scales.shape[1], x.stride(0), y.stride(0),
        GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return y


# ---------------------------------------------------------------------------------------------
# the layout in torch: packing, and the reference


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 -> int32 [N, K/8] (nibble i of word j: column 8j + i)."""
    n, k = q.shape
    v = q.to(torch.int64).reshape(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, device=q.device)
    packed = (v << shifts).sum(-1)  # disjoint bits: the sum is the bitwise or
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # two's complement into int32


def _nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/8] -> int32 [N, K] in 0..15 (an arithmetic shift, then the low 4 bits)."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    return ((qweight[:, :, None] >> shifts) & 0xF).reshape(qweight.shape[0], -1)


def unpack_int4_rows(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/8] -> int64 [N, K] in 0..15."""
    return _nibbles(qweight).long()


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The layout's W [N, K]: (q - zero) * scale per group, computed in float32, then `dtype`.
    (Also what a packed layer runs for more rows than the GEMV takes: in place where it can, so
    the largest 8B projection needs ~1 GB of scratch, not 4.)"""
    w = _nibbles(qweight).float()
    n, k = w.shape
    if k % group_size == 0:
        g = w.view(n, k // group_size, group_size)
        g.sub_(zeros.float()[..., None]).mul_(scales.float()[..., None])
    else:  # a partial last group
        w.sub_(zeros.float().repeat_interleave(group_size, dim=1)[:, :k])
        w.mul_(scales.float().repeat_interleave(group_size, dim=1)[:, :k])
    return w.to(dtype)


def int4_gemv_torch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """The reference for `int4_gemv`: dequantize, multiply in float32, round once to x's dtype."""
    w = dequantize_int4(qweight, scales, zeros, group_size)
    return F.linear(x.float(), w).to(x.dtype)
