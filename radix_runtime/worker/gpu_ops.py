"""Fused GPU kernels for the CUDA path: Triton RoPE and KV store, FlashInfer norms and SiLU-and-mul.

Each replaces a chain of small torch ops with one kernel. On a decode step of an 8B model the
weights take ~3.5 ms to stream, and every extra tiny kernel costs ~2-3 us even inside a CUDA
graph: the reference model's ~40 kernels per layer would add ~3 ms; this path runs ~11.

Numerics: each kernel computes in float32 and rounds once, where the torch reference rounds to
the model dtype after every op (as Hugging Face does); the difference is within bf16 rounding.

Only imported on CUDA (`available()` says whether it can be): Triton and FlashInfer are the
`gpu` extra, never needed on CPU. The torch versions (`*_torch`) are what the kernels are tested
and benchmarked against (bench/gpu_kernels.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

try:
    from flashinfer.activation import silu_and_mul as _fi_silu_and_mul
    from flashinfer.norm import fused_add_rmsnorm as _fi_fused_add_rmsnorm
    from flashinfer.norm import rmsnorm as _fi_rmsnorm
except ImportError:  # available() says False; the Triton kernels still work (and are tested)
    _fi_silu_and_mul = _fi_fused_add_rmsnorm = _fi_rmsnorm = None


def available() -> bool:
    """Whether the fused path can run: FlashInfer importable (Triton is, or this would not import)."""
    return _fi_rmsnorm is not None


# ---------------------------------------------------------------------------------------------
# RoPE (rotate-half convention) on the q and k heads of the fused qkv projection


@triton.jit
def _rotary_qk_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    qkv_stride,
    cs_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # one program per token: every q and k head of that token, each head as two halves
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    cos = tl.load(cos_ptr + t * cs_stride + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * cs_stride + d).to(tl.float32)
    in_qk = h < NUM_HEADS + NUM_KV_HEADS
    src = qkv_ptr + t * qkv_stride + h * HEAD_DIM + d  # q heads then k heads, contiguous
    x1 = tl.load(src, mask=in_qk, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=in_qk, other=0.0).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty)
    is_q = h < NUM_HEADS
    q_dst = q_out_ptr + t * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    tl.store(q_dst, o1, mask=is_q)
    tl.store(q_dst + HALF, o2, mask=is_q)
    is_k = in_qk & (h >= NUM_HEADS)
    k_dst = k_out_ptr + t * (NUM_KV_HEADS * HEAD_DIM) + (h - NUM_HEADS) * HEAD_DIM + d
    tl.store(k_dst, o1, mask=is_k)
    tl.store(k_dst + HALF, o2, mask=is_k)


def rotary_qk(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [N, (H + 2 Hkv) * D]; cos/sin [N, 1, D] (halves equal, as RotaryEmbedding gives them)
    -> rotated q [N, H, D] and k [N, Hkv, D], both new contiguous tensors."""
    n = qkv.shape[0]
    if head_dim & (head_dim - 1) or qkv.stride(1) != 1:
        return rotary_qk_torch(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    q = torch.empty((n, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((n, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q, k
    cos2, sin2 = cos.reshape(n, head_dim), sin.reshape(n, head_dim)
    _rotary_qk_kernel[(n,)](
        qkv,
        cos2,
        sin2,
        q,
        k,
        qkv.stride(0),
        cos2.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads),
        num_warps=4,
    )
    return q, k


def rotary_qk_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    from radix_runtime.worker.models.llama import apply_rope

    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
    return (
        apply_rope(q.reshape(-1, num_heads, head_dim), cos, sin),
        apply_rope(k.reshape(-1, num_kv_heads, head_dim), cos, sin),
    )


# ---------------------------------------------------------------------------------------------
# writing one layer's new K and V into their pool locations


@triton.jit
def _store_kv_kernel(
    k_cache_ptr,
    v_cache_ptr,
    loc_ptr,
    k_ptr,
    v_ptr,
    k_stride,
    v_stride,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per token: K and V rows (kv_heads * head_dim each) to the token's location
    t = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + t * k_stride + offs, mask=mask)
    v = tl.load(v_ptr + t * v_stride + offs, mask=mask)
    tl.store(k_cache_ptr + loc * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + loc * ROW + offs, v, mask=mask)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_cache/v_cache: one layer's pool buffers (any shape whose rows are [kv_heads, head_dim],
    contiguous); loc [N] flat locations; k/v [N, kv_heads, head_dim] with each row contiguous
    (v may be a strided view into the qkv projection)."""
    n = k.shape[0]
    if n == 0:
        return
    if loc.shape != (n,) or v.shape != k.shape:
        raise ValueError(f"store_kv: {n} rows of K, {v.shape[0]} of V, {loc.shape} locations")
    row = k.shape[1] * k.shape[2]
    for x in (k, v):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError("store_kv needs rows of [kv_heads, head_dim] laid out contiguously")
    _store_kv_kernel[(n,)](
        k_cache,
        v_cache,
        loc,
        k,
        v,
        k.stride(0),
        v.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        num_warps=4,
    )


def store_kv_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """The reference: two index_put_ writes into the flat [slots, kv_heads, head_dim] views."""
    flat = (-1, k.shape[1], k.shape[2])
    k_cache.view(flat)[loc] = k
    v_cache.view(flat)[loc] = v


# ---------------------------------------------------------------------------------------------
# batch-1 matrix-vector products (a decode step of one request streams every weight once)

# bench/gpu_worker.py A/B-measures decode with and without it (graphs captured each way).
# Measured in a batch-1 graph of the 8B model (docs/gpu_notes.md): cuBLAS splits K and adds a
# reduction kernel for the narrower projections (qkv, o, down), where this kernel is as fast
# or faster in one launch; for the wide ones (gate/up 28,672 rows, the LM head 128,256) cuBLAS's
# single kernel streams faster (3.9-4.3 TB/s), so those stay with cuBLAS.
USE_TRITON_GEMV = True
GEMV_MAX_ROWS = 8192


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bk, w, st in [
            (4, 1024, 4, 3),
            (8, 512, 4, 3),
            (8, 1024, 8, 3),
            (16, 256, 4, 4),
            (16, 512, 8, 3),
            (32, 256, 8, 3),
        ]
    ],
    key=["N", "K"],
    cache_results=True,  # on disk: a restarted server does not tune again
)
@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # y[n] = sum_k x[k] * w[n, k]; each program owns BLOCK_N rows of w and walks all of K
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rn < N
    rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(rows + rk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + rn, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_ok)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, with a Triton GEMV for single-row inputs (no bias, contiguous operands)."""
    if (
        USE_TRITON_GEMV
        and x.shape[0] == 1
        and weight.shape[0] <= GEMV_MAX_ROWS
        and bias is None
        and x.is_contiguous()
        and weight.is_contiguous()
    ):
        n, k = weight.shape
        y = torch.empty((1, n), dtype=x.dtype, device=x.device)
        _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](x, weight, y, n, k)
        return y
    return F.linear(x, weight, bias)


# ---------------------------------------------------------------------------------------------
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


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    rows, inter = x.shape[0], x.shape[1] // 2
    y = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows:
        block = 1024
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](x, y, inter, BLOCK=block)
    return y


# ---------------------------------------------------------------------------------------------
# FlashInfer's precompiled norm and activation kernels


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _fi_rmsnorm(x, weight, eps)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x; x = rmsnorm(residual) * weight, both in place; returns x."""
    _fi_fused_add_rmsnorm(x, residual, weight, eps)
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> silu(gate) * up, [N, I]."""
    if x.shape[0] <= TRITON_SILU_MAX_ROWS and x.is_contiguous():
        return silu_and_mul_triton(x)
    return _fi_silu_and_mul(x)
