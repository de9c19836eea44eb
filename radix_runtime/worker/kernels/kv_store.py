"""Writing one layer's new K and V into their pool locations (one Triton launch for both; an FP8
pool stores x / scale), and the torch reference."""

from __future__ import annotations

import torch

from radix_runtime.worker.kernels._triton import pdl_launch, pdl_wait, tl, triton


@triton.jit
def _store_kv_kernel(
    k_cache_ptr,
    v_cache_ptr,
    loc_ptr,
    k_ptr,
    v_ptr,
    k_stride,
    v_stride,
    k_inv_scale,
    v_inv_scale,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # one program per token: K and V rows (kv_heads * head_dim each) to the token's location
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + t * k_stride + offs, mask=mask)
    v = tl.load(v_ptr + t * v_stride + offs, mask=mask)
    if FP8:  # x / scale, clamped to e4m3's finite range (no inf in e4m3fn), rounded to FP8
        k = tl.clamp(k.to(tl.float32) * k_inv_scale, -448.0, 448.0).to(k_cache_ptr.dtype.element_ty)
        v = tl.clamp(v.to(tl.float32) * v_inv_scale, -448.0, 448.0).to(v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + loc * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + loc * ROW + offs, v, mask=mask)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    pdl: bool = False,
) -> None:
    """k_cache/v_cache: one layer's pool buffers (any shape whose rows are [kv_heads, head_dim],
    contiguous); loc [N] flat locations; k/v [N, kv_heads, head_dim] with each row contiguous
    (v may be a strided view into the qkv projection). An FP8 pool stores x / scale.
    `pdl`: launch dependently (kernels/_triton.py)."""
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
        1.0 / k_scale,
        1.0 / v_scale,
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
        **pdl_launch(pdl),
    )


def store_kv_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """The reference: two index_put_ writes into the flat [slots, kv_heads, head_dim] views."""
    flat = (-1, k.shape[1], k.shape[2])
    if k_cache.dtype == torch.float8_e4m3fn:
        k = (k.float() / k_scale).clamp(-448.0, 448.0).to(k_cache.dtype)
        v = (v.float() / v_scale).clamp(-448.0, 448.0).to(v_cache.dtype)
    k_cache.view(flat)[loc] = k
    v_cache.view(flat)[loc] = v
