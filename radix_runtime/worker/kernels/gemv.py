"""Batch-1 GEMV with the layer's small ops fused in (the decode step of one request), its tuned
configurations, and the torch reference.

One decode step of one request is a chain of matrix-vector products with tiny ops between
them; each tiny op is a kernel of its own (~2-3 us in a graph, x 32 layers). This GEMV takes
them in: its prologue can build x on the fly as RMSNorm(residual) * w (the norm's sum of
squares is accumulated in the same K loop, so the input is read once; 1/rms scales the dot
products at the end), or as SiLU(gate) * up from the gate/up projection's output; its
epilogue can add the result into the residual stream in place. A layer is then
    qkv = W_qkv . norm(res)   RoPE, attention   res += W_o . attn
    gu = W_gu . norm(res)     res += W_down . silu(gu[:I]) * gu[I:]
with no separate norm, add or activation kernels. Each program owns BLOCK_N whole rows, so
the reduction order is fixed (no atomics: the same input gives the same bits every run).
Whether the model's one-token path and single-row projections use it is the runner's
`KernelConfig` (`row_fusion`, `triton_gemv`; bench/gpu_worker.py A/Bs both).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from radix_runtime.worker.kernels._triton import pdl_launch, pdl_wait, tl, triton
from radix_runtime.worker.kernels.activation import gelu_tanh_and_mul_torch, silu_and_mul_torch

GEMV_PLAIN, GEMV_NORM, GEMV_SILU, GEMV_GELU = 0, 1, 2, 3
FP8_GEMV_ROWS_FACTOR = 2  # BLOCK_N of an FP8 weight's GEMV over the bf16 table's (bench/quant.py)

GemvTable = Mapping[tuple[int, int, int, bool], tuple[int, int, int]]


@triton.jit
def _gemv_weights(rows, rk, row_ok, K, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weights at columns `rk` of the program's rows."""
    if EVEN_K:
        return tl.load(rows + rk[None, :], mask=row_ok[:, None], other=0.0,
                       eviction_policy="evict_first")  # fmt: skip
    return tl.load(rows + rk[None, :], mask=row_ok[:, None] & (rk < K)[None, :], other=0.0,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _gemv_step(x_ptr, norm_ptr, w, rk, K, acc, sq, PROLOGUE: tl.constexpr, EVEN_K: tl.constexpr):
    """acc += w * f(x) at columns `rk` (and the norm's sum of squares)."""
    k_ok = rk < K  # (unused when EVEN_K)
    if PROLOGUE >= 2:  # gated: act(x[:K]) * x[K:]
        if EVEN_K:
            g = tl.load(x_ptr + rk).to(tl.float32)
            up = tl.load(x_ptr + K + rk).to(tl.float32)
        else:
            g = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + rk, mask=k_ok, other=0.0).to(tl.float32)
        if PROLOGUE == 2:  # SiLU
            x = g / (1.0 + tl.exp(-g)) * up
        else:  # gelu(tanh): 0.5 g (1 + tanh(y)) = g * sigmoid(2 y), y = sqrt(2 / pi) (g + 0.044715 g^3)
            x = g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g))) * up
    else:
        if EVEN_K:
            x = tl.load(x_ptr + rk).to(tl.float32)
        else:
            x = tl.load(x_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            sq += x * x
            if EVEN_K:
                x = x * tl.load(norm_ptr + rk).to(tl.float32)
            else:
                x = x * tl.load(norm_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
    acc += w.to(tl.float32) * x[None, :]
    return acc, sq


@triton.jit
def _gemv_fused_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    norm_ptr,
    scale_ptr,
    N,
    K,
    eps,
    SCALED: tl.constexpr,  # W is FP8 with one float32 scale per row (scale_ptr)
    PROLOGUE: tl.constexpr,  # GEMV_PLAIN x | GEMV_NORM rmsnorm(x) * norm | GEMV_SILU silu(x[:K]) * x[K:] | GEMV_GELU gelu_tanh(x[:K]) * x[K:]
    ADD: tl.constexpr,  # y += W . x (y is the residual stream) instead of y = W . x
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched dependently: the first weight block streams before the wait
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rn < N
    rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    rk0 = tl.arange(0, BLOCK_K)
    if USE_PDL:  # weights are never written by a kernel: their loads need not wait
        w0 = _gemv_weights(rows, rk0, row_ok, K, EVEN_K)
        pdl_wait(USE_PDL)
    if ADD:  # fetched first: its latency hides behind the weight stream, not after it
        y0 = tl.load(y_ptr + rn, mask=row_ok, other=0.0).to(tl.float32)
    k_start = 0
    if USE_PDL:
        acc, sq = _gemv_step(x_ptr, norm_ptr, w0, rk0, K, acc, sq, PROLOGUE, EVEN_K)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        rk = k0 + rk0
        w = _gemv_weights(rows, rk, row_ok, K, EVEN_K)
        acc, sq = _gemv_step(x_ptr, norm_ptr, w, rk, K, acc, sq, PROLOGUE, EVEN_K)
    y = tl.sum(acc, axis=1)
    if SCALED:
        y = y * tl.load(scale_ptr + rn, mask=row_ok, other=0.0)
    if PROLOGUE == 1:
        y = y * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    if ADD:
        y += y0
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=row_ok)


# (BLOCK_N, BLOCK_K, num_warps) per (rows, cols, prologue, add), measured on the H200 by
# bench/gemv_sweep.py; keys not listed get GEMV_DEFAULT_CONFIG (the Qwen3-8B and Gemma-3-12B
# shapes: their sweep winners alone lost in the decode step with dependent launches,
# docs/decisions.md). The fused prologues re-read
# the input row in every program, so they want more rows per program than the plain product.
GEMV_CONFIGS: dict[tuple[int, int, int, bool], tuple[int, int, int]] = {
    # Llama-3.1-8B (docs/results/h200_gemv_sweep.json; us per product there, cuBLAS in brackets)
    (6144, 4096, GEMV_PLAIN, False): (2, 1024, 4),  # qkv 13.7 (15.5)
    (6144, 4096, GEMV_NORM, False): (8, 512, 4),  # qkv from the residual 14.1
    (4096, 4096, GEMV_PLAIN, False): (4, 1024, 2),  # o 10.0 (13.7)
    (4096, 4096, GEMV_PLAIN, True): (4, 1024, 4),  # o into the residual 10.0
    (28672, 4096, GEMV_PLAIN, False): (2, 2048, 2),  # gate/up 53.9 (55.7)
    (28672, 4096, GEMV_NORM, False): (16, 256, 4),  # gate/up from the residual 55.3
    (4096, 14336, GEMV_PLAIN, False): (2, 2048, 2),  # down 28.4 (31.7)
    (4096, 14336, GEMV_SILU, True): (8, 1024, 4),  # down of SiLU(gate) * up, into the residual 29.5
    (128256, 4096, GEMV_PLAIN, False): (4, 2048, 4),  # LM head 229.7 (239.2)
}
GEMV_DEFAULT_CONFIG = {GEMV_PLAIN: (4, 1024, 4), GEMV_NORM: (8, 512, 4), GEMV_SILU: (8, 1024, 4),
                       GEMV_GELU: (8, 1024, 4)}  # fmt: skip
# FP8 weights (W8A16 at batch 1), the one-token layer's cases of the 8B shape, measured on the
# H200 by bench/quant.py's FP8 sweep (docs/results/h200_quant_gemv.json, us per product); other
# keys take the bf16 table's config with FP8_GEMV_ROWS_FACTOR x its rows
FP8_GEMV_CONFIGS: dict[tuple[int, int, int, bool], tuple[int, int, int]] = {
    (6144, 4096, GEMV_NORM, False): (8, 512, 4),  # qkv from the residual 10.5
    (4096, 4096, GEMV_PLAIN, True): (4, 1024, 4),  # o into the residual 7.2
    (28672, 4096, GEMV_NORM, False): (8, 512, 4),  # gate/up from the residual 37.2
    (4096, 14336, GEMV_SILU, True): (8, 1024, 4),  # down of SiLU(gate) * up, into the residual 20.8
}
GEMV_CONFIGS_ENV = "RADIX_RUNTIME_GEMV_CONFIGS"  # a gemv_sweep.py JSON whose best configs win


def load_gemv_configs(path: str) -> dict[tuple[int, int, int, bool], tuple[int, int, int]]:
    """The best configuration of each case of a bench/gemv_sweep.py result."""
    with open(path) as f:
        cases = json.load(f)["cases"]
    return {(c["rows"], c["cols"], c["prologue"], c["add"]): tuple(c["best_config"]) for c in cases}


def default_gemv_configs() -> dict[tuple[int, int, int, bool], tuple[int, int, int]]:
    """GEMV_CONFIGS, with the best configs of the sweep named by $RADIX_RUNTIME_GEMV_CONFIGS."""
    table = dict(GEMV_CONFIGS)
    if os.environ.get(GEMV_CONFIGS_ENV):
        table.update(load_gemv_configs(os.environ[GEMV_CONFIGS_ENV]))
    return table


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu: bool = False,
    gelu: bool = False,
    add_to: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
    w_scale: torch.Tensor | None = None,
    table: GemvTable | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """One row: y = W . f(x), W [N, K] contiguous, where f(x) is x; rmsnorm(x) * norm_weight
    (`norm_weight` given; x [1, K]); silu(x[:, :K]) * x[:, K:] (`silu`; x [1, 2K]); or
    gelu_tanh(x[:, :K]) * x[:, K:] (`gelu`; x [1, 2K]).
    With `add_to` ([1, N]) the product is added into it in place and it is returned.
    An FP8 W comes with `w_scale` (float32 [N], one per row): the weight stream is half of
    bf16's bytes, widened in registers; x stays in its dtype (W8A16 at batch 1).
    `config` (BLOCK_N, BLOCK_K, num_warps) overrides the lookup in `table` (by default the
    H200's GEMV_CONFIGS). `pdl`: launch dependently (`_triton.pdl_supported()` must hold): the
    kernel starts while the one before it finishes, its first weight block streaming before it
    waits for that kernel's writes."""
    n, k = weight.shape
    if x.shape[0] != 1 or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("gemv takes one contiguous input row and a contiguous weight")
    gated = silu or gelu
    if x.shape[1] != (2 * k if gated else k):
        raise ValueError(f"gemv: input of {x.shape[1]} columns for a weight of {k}")
    if (silu and gelu) or (gated and norm_weight is not None):
        raise ValueError("gemv: one prologue at a time (norm, SiLU or GELU)")
    prologue = (
        GEMV_SILU if silu else GEMV_GELU if gelu else GEMV_NORM if norm_weight is not None
        else GEMV_PLAIN
    )  # fmt: skip
    if add_to is None:
        y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    else:
        if add_to.shape != (1, n) or not add_to.is_contiguous():
            raise ValueError(f"gemv: add_to must be a contiguous [1, {n}] row")
        y = add_to
    key = (n, k, prologue, add_to is not None)
    if config is None and w_scale is not None and key in FP8_GEMV_CONFIGS:
        config = FP8_GEMV_CONFIGS[key]
    block_n, block_k, warps = config or (GEMV_CONFIGS if table is None else table).get(
        key, GEMV_DEFAULT_CONFIG[prologue]
    )
    if w_scale is not None and config is None:
        # FP8 rows are half as many bytes: twice the rows per program keeps each program's
        # loads the size the bf16 sweep chose
        block_n *= FP8_GEMV_ROWS_FACTOR
    _gemv_fused_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        y,
        x if norm_weight is None else norm_weight,
        x if w_scale is None else w_scale,
        n,
        k,
        eps,
        SCALED=w_scale is not None,
        PROLOGUE=prologue,
        ADD=add_to is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        num_warps=warps,
        **pdl_launch(pdl),
    )
    return y


def gemv_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    silu: bool = False,
    gelu: bool = False,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference for `gemv`, in float32."""
    xf = x.float()
    if silu or gelu:
        xf = (silu_and_mul_torch if silu else gelu_tanh_and_mul_torch)(xf)
    elif norm_weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = F.linear(xf, weight.float())
    if add_to is None:
        return y.to(x.dtype)
    add_to.copy_((add_to.float() + y).to(add_to.dtype))
    return add_to
