"""W4A16: packed int4 weights dequantized in registers, a GEMV for decode rows (with the bf16
GEMV's fused prologues and epilogue) and a GEMM for many rows, and the torch reference.

The layout (what worker/quant.py's `Int4Linear` holds, repacked at load from AWQ's or GPTQ's):
- `qweight` int32 [N/4, K/8, 4] (`interleave_quads` of the rows as loaded, `pack_int4_rows`):
  the words of four consecutive rows interleaved, so one 16-byte
  load is the same word of four rows (a GEMV thread then reuses each input value four times);
  nibble i (bits 4i..4i+3) of word j of row n holds q[n, 8j + i], 0..15 (a row is contiguous
  along the reduction dim: a GEMV streams it);
- `scales` float32 [N, ceil(K/G)] and `zeros` uint8 [N, ceil(K/G)] per group of G input columns
  (G a multiple of 8), w[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G];
- for the GEMV, `gemv_scales` float32 [N/4, ceil(K/G), 2, 4] (built from them at load):
  a = 16 * scale and c = -scale * zero of the four rows of a quad.

The GEMV never forms w, nor converts an integer to float per weight. Each pair of nibbles
(2p, 2p+1) of a word is shifted once so that it sits in float32 mantissa bits 15..22; one and-or
(one lop3) per nibble then makes f = 16 + q/16 of the low nibble (exponent of 16, its bits at
15..18) and f = 1 + q/16 of the high one (exponent of 1, bits 19..22), exactly. So per weight
that is half a shift, an and-or and an FMA, and with x' = 16 x (low nibbles) or x (high ones):
    sum f x = sum x' + sum q x / 16,   sum w x = a * (sum f x - sum x') + c * sum x
per word and row (a, c of its group), the input sums shared by the four rows (and by the other
quads of the program).
Each program owns BLOCK_Q quads (4 * BLOCK_Q rows) of one input row, the K loop in steps of
BLOCK_KW words (no split-K, no atomics: the same bits every run); the input rows of a small
batch are the grid's fastest axis, so the programs that read the same weights run together and
share them through L2.

Numerics: float32 throughout (f x is exact to float32 rounding: f in [1, 32) and the sum over a
word cancels only x's own sum), rounded once; the reference dequantizes to float32.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from radix_runtime.worker.kernels._triton import pdl_launch, pdl_wait, tl, triton

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INT4_PLAIN, INT4_NORM, INT4_SILU = 0, 1, 2  # the prologues (as kernels/gemv.py's GEMV_*)
# (BLOCK_Q quads of rows, BLOCK_KW words per K step, num_warps)
INT4_GEMV_DEFAULT_CONFIG = (4, 256, 4)
# per (rows, cols, prologue, add) of the one-token layer's GEMVs of the 8B shape, measured on the
# H200 (docs/results/h200_quant_kernels.json: us per product, the bf16 GEMV in brackets); other
# keys get INT4_GEMV_DEFAULT_CONFIG
INT4_GEMV_CONFIGS: dict[tuple[int, int, int, bool], tuple[int, ...]] = {
    (6144, 4096, INT4_NORM, False): (4, 256, 4),  # qkv from the residual 8.5 (15.3)
    (4096, 4096, INT4_PLAIN, True): (4, 512, 8),  # o into the residual 6.2 (11.1)
    (28672, 4096, INT4_NORM, False): (4, 128, 2),  # gate/up from the residual 28.3 (66.9)
    (4096, 14336, INT4_SILU, True): (4, 256, 8),  # down of SiLU(gate) * up, + residual 18.2 (35.8)
}


@triton.jit
def _nibble_floats(words, P: tl.constexpr, ASM: tl.constexpr):
    """Nibbles 2P and 2P+1 of each word as floats 16 + q/16 and 1 + q/16."""
    if P * 8 <= 15:
        t = words << (15 - 8 * P)
    else:
        t = words >> (8 * P - 15)
    if ASM:  # (t & mask) | exponent as one lop3 (the compiler emits an and, then an or)
        lo = tl.inline_asm_elementwise("lop3.b32 $0, $1, 491520, 1098907648, 234;", "=r,r", [t],
                                       dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
        hi = tl.inline_asm_elementwise("lop3.b32 $0, $1, 7864320, 1065353216, 234;", "=r,r", [t],
                                       dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    else:
        lo = (t & 0x00078000) | 0x41800000
        hi = (t & 0x00780000) | 0x3F800000
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def _gemv_input(x_row, norm_ptr, col, ok, K, PROLOGUE: tl.constexpr):
    """The GEMV's input at columns `col`: x, x * norm (the rmsnorm's 1/rms comes at the end), or
    silu(x[:K]) * x[K:]; and x's square (the norm's sum of squares)."""
    if PROLOGUE == 2:
        g = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
        v = g / (1.0 + tl.exp(-g)) * tl.load(x_row + K + col, mask=ok, other=0.0).to(tl.float32)
        return v, v
    v = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
    if PROLOGUE == 1:
        return v * tl.load(norm_ptr + col, mask=ok, other=0.0).to(tl.float32), v * v
    return v, v


@triton.jit
def _weight_block(w_base, ac_base, kw0, kw_total, q_ok, WG: tl.constexpr, BLOCK_KW: tl.constexpr,
                  EVEN: tl.constexpr):  # fmt: skip
    """The [BLOCK_KW, BLOCK_Q, 4] words from word kw0 on, and their groups' a and c."""
    w = kw0 + tl.arange(0, BLOCK_KW)
    ac_w = ac_base + ((w // WG) * 8)[:, None, None]
    if EVEN:  # whole blocks of words and quads: no masks on the weight stream
        words = tl.load(w_base + (w * 4)[:, None, None], eviction_policy="evict_first")
        a = tl.load(ac_w)
        c = tl.load(ac_w + 4)
    else:
        ok3 = (w < kw_total)[:, None, None] & q_ok[None, :, None]
        words = tl.load(w_base + (w * 4)[:, None, None], mask=ok3, other=0,
                        eviction_policy="evict_first")  # fmt: skip
        a = tl.load(ac_w, mask=ok3, other=0.0)
        c = tl.load(ac_w + 4, mask=ok3, other=0.0)
    return words, a, c


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    qw_ptr,
    ac_ptr,
    y_ptr,
    norm_ptr,
    N,
    K,
    kw_total,  # K // 8: a row's words (an argument, so that Triton sees its divisibility by 16)
    groups,
    x_stride,
    y_stride,
    eps,
    GROUP: tl.constexpr,
    PROLOGUE: tl.constexpr,  # 0 x | 1 rmsnorm(x) * norm | 2 silu(x[:K]) * x[K:]
    ADD: tl.constexpr,  # y += W . x (the residual stream) instead of y = W . x
    BLOCK_Q: tl.constexpr,
    BLOCK_KW: tl.constexpr,
    EVEN: tl.constexpr,  # K // 8 a multiple of BLOCK_KW and N // 4 of BLOCK_Q
    PREFETCH: tl.constexpr,  # load the next block's weights before this block's arithmetic
    ASM: tl.constexpr,  # PTX inline assembly (not in Triton's CPU interpreter)
    USE_PDL: tl.constexpr,  # launched dependently (with PREFETCH the first block loads before the wait)
):
    WG: tl.constexpr = GROUP // 8  # words per group
    m = tl.program_id(0).to(tl.int64)  # the input row (fastest: the weight rows stay in L2)
    quad = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = quad < N // 4
    t = tl.arange(0, 4)
    x_row = x_ptr + m * x_stride
    rows = quad[:, None] * 4 + t[None, :]  # [BLOCK_Q, 4]
    # tiles [BLOCK_KW words, BLOCK_Q quads, 4 rows]: words first, so that the threads spread
    # along the words and each holds whole quads (and reuses its inputs 4 * BLOCK_Q times)
    acc = tl.zeros((BLOCK_KW, BLOCK_Q, 4), dtype=tl.float32)
    sq = tl.zeros((BLOCK_KW,), dtype=tl.float32)
    # the quads' first words, and first scales (int32 offsets: a weight has < 2^31 words)
    w_base = qw_ptr + ((quad * kw_total)[None, :, None] * 4 + t[None, None, :])
    ac_base = ac_ptr + ((quad * groups)[None, :, None] * 8 + t[None, None, :])
    if PREFETCH:  # the first block's words and scales, before the loop
        words_n, a_n, c_n = _weight_block(w_base, ac_base, 0, kw_total, q_ok, WG, BLOCK_KW, EVEN)
    pdl_wait(USE_PDL)  # (weights are never written by a kernel: only x and y wait)
    if ADD:  # fetched first: its latency hides behind the weight stream
        y0 = tl.load(y_ptr + m * y_stride + rows, mask=q_ok[:, None], other=0.0).to(tl.float32)
    for kw0 in range(0, kw_total, BLOCK_KW):
        w = kw0 + tl.arange(0, BLOCK_KW)
        w_ok = w < kw_total  # (the input's loads keep it: one compare per word)
        if PREFETCH:  # this block's were loaded a step ago; the next block's loads go out now
            words, a, c = words_n, a_n, c_n
            words_n, a_n, c_n = _weight_block(w_base, ac_base, kw0 + BLOCK_KW, kw_total, q_ok,
                                              WG, BLOCK_KW, False)  # fmt: skip
        else:
            words, a, c = _weight_block(w_base, ac_base, kw0, kw_total, q_ok, WG, BLOCK_KW, EVEN)
        col = w * 8
        x0, s0 = _gemv_input(x_row, norm_ptr, col, w_ok, K, PROLOGUE)
        x1, s1 = _gemv_input(x_row, norm_ptr, col + 1, w_ok, K, PROLOGUE)
        x2, s2 = _gemv_input(x_row, norm_ptr, col + 2, w_ok, K, PROLOGUE)
        x3, s3 = _gemv_input(x_row, norm_ptr, col + 3, w_ok, K, PROLOGUE)
        x4, s4 = _gemv_input(x_row, norm_ptr, col + 4, w_ok, K, PROLOGUE)
        x5, s5 = _gemv_input(x_row, norm_ptr, col + 5, w_ok, K, PROLOGUE)
        x6, s6 = _gemv_input(x_row, norm_ptr, col + 6, w_ok, K, PROLOGUE)
        x7, s7 = _gemv_input(x_row, norm_ptr, col + 7, w_ok, K, PROLOGUE)
        if PROLOGUE == 1:
            sq += ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
        xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))  # sum x
        xs16 = ((x0 + x2) + (x4 + x6)) * 16.0 + ((x1 + x3) + (x5 + x7))  # sum x'
        f0, f1 = _nibble_floats(words, 0, ASM)
        part = f0 * x0[:, None, None] - xs16[:, None, None]
        part += f1 * x1[:, None, None]
        f2, f3 = _nibble_floats(words, 1, ASM)
        part += f2 * x2[:, None, None]
        part += f3 * x3[:, None, None]
        f4, f5 = _nibble_floats(words, 2, ASM)
        part += f4 * x4[:, None, None]
        part += f5 * x5[:, None, None]
        f6, f7 = _nibble_floats(words, 3, ASM)
        part += f6 * x6[:, None, None]
        part += f7 * x7[:, None, None]
        acc += a * part  # two FMAs (a * part + c * xs would be a product, an FMA and an add)
        acc += c * xs[:, None, None]
    y = tl.sum(acc, axis=0)  # [BLOCK_Q, 4]
    if PROLOGUE == 1:
        y = y * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    if ADD:
        y += y0
    tl.store(y_ptr + m * y_stride + rows, y.to(y_ptr.dtype.element_ty), mask=q_ok[:, None])


@triton.jit
def _row_step(x_ptr, m, M, x_stride, w, w_ok, f0, f1, f2, f3, f4, f5, f6, f7, a, c, acc):
    """One input row's share of a block: acc += a * (sum f x - sum x') + c * sum x (the nibble
    floats f0..f7 made once for all rows)."""
    ok = w_ok & (m < M)
    p = x_ptr + m.to(tl.int64) * x_stride + w * 8
    x0 = tl.load(p, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(p + 1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p + 2, mask=ok, other=0.0).to(tl.float32)
    x3 = tl.load(p + 3, mask=ok, other=0.0).to(tl.float32)
    x4 = tl.load(p + 4, mask=ok, other=0.0).to(tl.float32)
    x5 = tl.load(p + 5, mask=ok, other=0.0).to(tl.float32)
    x6 = tl.load(p + 6, mask=ok, other=0.0).to(tl.float32)
    x7 = tl.load(p + 7, mask=ok, other=0.0).to(tl.float32)
    xs = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    xs16 = ((x0 + x2) + (x4 + x6)) * 16.0 + ((x1 + x3) + (x5 + x7))
    part = f0 * x0[:, None, None] - xs16[:, None, None]
    part += f1 * x1[:, None, None]
    part += f2 * x2[:, None, None]
    part += f3 * x3[:, None, None]
    part += f4 * x4[:, None, None]
    part += f5 * x5[:, None, None]
    part += f6 * x6[:, None, None]
    part += f7 * x7[:, None, None]
    acc += a * part
    acc += c * xs[:, None, None]
    return acc


@triton.jit
def _row_store(y_ptr, m, M, y_stride, quad, q_ok, t, acc):
    y = tl.sum(acc, axis=0)  # [BLOCK_Q, 4]
    out = y_ptr + m.to(tl.int64) * y_stride + quad[:, None] * 4 + t[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=q_ok[:, None] & (m < M))


@triton.jit
def _int4_rows_kernel(
    x_ptr,
    qw_ptr,
    ac_ptr,
    y_ptr,
    M,
    N,
    kw_total,
    groups,
    x_stride,
    y_stride,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 2 or 4 input rows per program
    BLOCK_Q: tl.constexpr,
    BLOCK_KW: tl.constexpr,
    EVEN: tl.constexpr,
    ASM: tl.constexpr,
):
    """The GEMV for a few input rows at once: each block of weights is loaded and made floats
    once for BLOCK_M input rows (then one FMA per weight and row), instead of once per row."""
    WG: tl.constexpr = GROUP // 8
    m0 = tl.program_id(0) * BLOCK_M  # fastest: the programs of one weight block run together
    quad = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_ok = quad < N // 4
    t = tl.arange(0, 4)
    acc0 = tl.zeros((BLOCK_KW, BLOCK_Q, 4), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_KW, BLOCK_Q, 4), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_KW, BLOCK_Q, 4), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_KW, BLOCK_Q, 4), dtype=tl.float32)
    w_base = qw_ptr + ((quad * kw_total)[None, :, None] * 4 + t[None, None, :])
    ac_base = ac_ptr + ((quad * groups)[None, :, None] * 8 + t[None, None, :])
    for kw0 in range(0, kw_total, BLOCK_KW):
        w = kw0 + tl.arange(0, BLOCK_KW)
        w_ok = w < kw_total
        words, a, c = _weight_block(w_base, ac_base, kw0, kw_total, q_ok, WG, BLOCK_KW, EVEN)
        f0, f1 = _nibble_floats(words, 0, ASM)
        f2, f3 = _nibble_floats(words, 1, ASM)
        f4, f5 = _nibble_floats(words, 2, ASM)
        f6, f7 = _nibble_floats(words, 3, ASM)
        fs = (f0, f1, f2, f3, f4, f5, f6, f7)
        acc0 = _row_step(x_ptr, m0, M, x_stride, w, w_ok, *fs, a, c, acc0)
        acc1 = _row_step(x_ptr, m0 + 1, M, x_stride, w, w_ok, *fs, a, c, acc1)
        if BLOCK_M == 4:
            acc2 = _row_step(x_ptr, m0 + 2, M, x_stride, w, w_ok, *fs, a, c, acc2)
            acc3 = _row_step(x_ptr, m0 + 3, M, x_stride, w, w_ok, *fs, a, c, acc3)
    _row_store(y_ptr, m0, M, y_stride, quad, q_ok, t, acc0)
    _row_store(y_ptr, m0 + 1, M, y_stride, quad, q_ok, t, acc1)
    if BLOCK_M == 4:
        _row_store(y_ptr, m0 + 2, M, y_stride, quad, q_ok, t, acc2)
        _row_store(y_ptr, m0 + 3, M, y_stride, quad, q_ok, t, acc3)


def int4_rows_config(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_KW, num_warps) of `int4_gemv_rows` for `m` input rows: 2 or 4
    rows per program (more rows: several row blocks, the weights then come from L2). Not measured
    on the GPU yet (bench/quant.py's by_rows, `int4_gemv_rows_us`)."""
    return (2, 4, 128, 4) if m <= 2 else (4, 2, 128, 4)


def int4_gemv_rows(
    x: torch.Tensor,
    qweight: torch.Tensor,
    gemv_scales: torch.Tensor,
    group_size: int,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`int4_gemv` (plain input) for a few rows x [M, K]: every weight block is read and made
    floats once for BLOCK_M (2 or 4) rows. `config` (BLOCK_M, BLOCK_Q, BLOCK_KW, num_warps)
    overrides `int4_rows_config(M)`."""
    k = qweight.shape[1] * 8
    if x.shape[1] != k:
        raise ValueError(f"int4_gemv_rows: input of {x.shape[1]} columns for a weight of {k}")
    if gemv_scales.shape[2:] != (2, 4):
        raise ValueError(f"int4_gemv_rows: gemv_scales {tuple(gemv_scales.shape)}")
    x, y = _operands("int4_gemv_rows", x, qweight, *gemv_scales.shape[:2], group_size, k)
    m, n = x.shape[0], y.shape[1]
    if m == 0:
        return y
    block_m, block_q, block_kw, warps = config or int4_rows_config(m)
    if block_m not in (2, 4):
        raise ValueError(f"int4_gemv_rows: BLOCK_M {block_m} (2 or 4)")
    grid = (triton.cdiv(m, block_m), triton.cdiv(n // 4, block_q))
    _int4_rows_kernel[grid](
        x, qweight, gemv_scales, y, m, n, k // 8, gemv_scales.shape[1], x.stride(0), y.stride(0),
        GROUP=group_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_KW=block_kw,
        EVEN=(k // 8) % block_kw == 0 and (n // 4) % block_q == 0, ASM=not _INTERPRET,
        num_warps=warps,
    )  # fmt: skip
    return y


def _operands(
    name: str,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale_rows: int,
    scale_groups: int,
    group_size: int,
    in_features: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 kernels' operand checks: x with unit column stride and the output y [M, N]
    (`in_features`: x's columns when they are not K, the SiLU prologue's 2K; `scale_rows` /
    `scale_groups`: the leading dims of the scales as given)."""
    m = x.shape[0]
    k = x.shape[1] if in_features is None else in_features
    nq = qweight.shape[0]
    if qweight.shape != (nq, k // 8, 4) or k % 8 or group_size % 8:
        raise ValueError(
            f"{name}: input of {k} columns, qweight {tuple(qweight.shape)}, group {group_size}"
        )
    if scale_groups != -(-k // group_size) or scale_rows not in (nq, 4 * nq):
        raise ValueError(
            f"{name}: scales of {scale_rows} x {scale_groups} for {tuple(qweight.shape)}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, torch.empty((m, 4 * nq), dtype=x.dtype, device=x.device)


def int4_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    gemv_scales: torch.Tensor,
    group_size: int,
    config: tuple[int, ...] | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu: bool = False,
    add_to: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x [M, K] (rows contiguous; a few rows: decode) -> x W^T [M, N] in x's dtype, W given in the
    layout above (`gemv_scales` from `int4_gemv_scales`). As kernels/gemv.py's `gemv`, the input
    can be rmsnorm(x) * norm_weight (`norm_weight`) or silu(x[:, :K]) * x[:, K:] (`silu`,
    x [M, 2K]), and with `add_to` ([M, N]) the product is added into it in place (returned).
    `config` (BLOCK_Q, BLOCK_KW, num_warps[, prefetch]) overrides INT4_GEMV_DEFAULT_CONFIG
    (prefetch 1: each step loads the next step's weights before its own arithmetic). `pdl`:
    launch dependently, as kernels/gemv.py's `gemv`."""
    if silu and norm_weight is not None:
        raise ValueError("int4_gemv: a norm and a SiLU prologue cannot be combined")
    k = qweight.shape[1] * 8
    if x.shape[1] != (2 * k if silu else k):
        raise ValueError(f"int4_gemv: input of {x.shape[1]} columns for a weight of {k}")
    if gemv_scales.shape[2:] != (2, 4):
        raise ValueError(f"int4_gemv: gemv_scales {tuple(gemv_scales.shape)}")
    x, y = _operands("int4_gemv", x, qweight, *gemv_scales.shape[:2], group_size, k)
    m, n = x.shape[0], y.shape[1]
    if add_to is not None:
        if add_to.shape != (m, n) or not add_to.is_contiguous():
            raise ValueError(f"int4_gemv: add_to must be a contiguous [{m}, {n}] tensor")
        y = add_to
    if m == 0:
        return y
    prologue = INT4_SILU if silu else INT4_NORM if norm_weight is not None else INT4_PLAIN
    block_q, block_kw, warps, *prefetch = config or INT4_GEMV_DEFAULT_CONFIG
    _int4_gemv_kernel[(m, triton.cdiv(n // 4, block_q))](
        x, qweight, gemv_scales, y, x if norm_weight is None else norm_weight, n, k, k // 8,
        gemv_scales.shape[1], x.stride(0), y.stride(0), eps, GROUP=group_size, PROLOGUE=prologue,
        ADD=add_to is not None, BLOCK_Q=block_q, BLOCK_KW=block_kw,
        EVEN=(k // 8) % block_kw == 0 and (n // 4) % block_q == 0,
        PREFETCH=bool(prefetch and prefetch[0]), ASM=not _INTERPRET,
        num_warps=warps, **pdl_launch(pdl),
    )  # fmt: skip
    return y


def int4_gemv_scales(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """scales float32 / zeros uint8 [N, groups] -> the GEMV's float32 [N/4, groups, 2, 4]:
    a = 16 * scale and c = -scale * zero, the four rows of a quad side by side."""
    n, groups = scales.shape
    s = scales.float()
    ac = torch.stack([16.0 * s, -s * zeros.float()], dim=-1)  # [N, groups, 2]
    return ac.view(n // 4, 4, groups, 2).permute(0, 2, 3, 1).contiguous()


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
    kw_total,  # K // 8
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
    quad_base = (w_rows // 4) * kw_total * 4 + w_rows % 4  # word 0 of each row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kw0 in range(0, kw_total, BLOCK_KW):
        jw = kw0 + tl.arange(0, BLOCK_KW)
        w_ok = jw < kw_total
        ok = n_ok[:, None] & w_ok[None, :]
        words = tl.load(qw_ptr + quad_base + jw[None, :] * 4, mask=ok, other=0)
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
    x, y = _operands("int4_gemm", x, qweight, *scales.shape, group_size)
    (m, k), n = x.shape, y.shape[1]
    if zeros.shape != scales.shape or scales.shape[0] != n:
        raise ValueError(f"int4_gemm: scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}")
    if m == 0:
        return y
    block_m, block_n, block_kw, warps, stages = config or int4_gemm_config(m)
    _int4_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, qweight, scales, zeros, y, m, n, k // 8, scales.shape[1], x.stride(0), y.stride(0),
        GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return y


# ---------------------------------------------------------------------------------------------
# the layout in torch: packing, and the reference


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 (K a multiple of 8) -> int32 [N, K/8], row by row (nibble i of
    word j: column 8j + i): how a checkpoint's rows are loaded, before `interleave_quads`."""
    n, k = q.shape
    v = q.to(torch.int64).reshape(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, device=q.device)
    packed = (v << shifts).sum(-1)  # disjoint bits: the sum is the bitwise or
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # two's complement into int32


def interleave_quads(rows: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/8] row by row (N a multiple of 4) -> the kernels' [N/4, K/8, 4]."""
    n, kw = rows.shape
    if n % 4:
        raise ValueError(f"int4 layout: {n} rows, not a multiple of 4")
    return rows.view(n // 4, 4, kw).transpose(1, 2).contiguous()


def _nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N/4, K/8, 4] -> int32 [N, K] in 0..15 (an arithmetic shift, then the low 4 bits)."""
    nq, kw, _ = qweight.shape
    words = qweight.transpose(1, 2).reshape(4 * nq, kw)
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    return ((words[:, :, None] >> shifts) & 0xF).reshape(4 * nq, -1)


def unpack_int4_rows(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N/4, K/8, 4] -> int64 [N, K] in 0..15."""
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
