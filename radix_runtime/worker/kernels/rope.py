"""RoPE (rotate-half convention) on the q and k heads of the fused qkv projection, optionally
with a per-head RMSNorm first (Qwen3, Gemma 3): one Triton kernel per call, and its torch reference.

Numerics: the kernel computes in float32 and rounds once; the reference rounds as Hugging Face
does (the difference is within bf16 rounding).
"""

from __future__ import annotations

import torch

from radix_runtime.worker.kernels._triton import pdl_launch, pdl_wait, tl, triton


@triton.jit
def _rotary_qk_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    qkv_stride,
    cs_stride,
    qn_ptr,
    kn_ptr,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NORM: tl.constexpr,
    NORM_OFFSET: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # one program per token: every q and k head of that token, each head as two halves
    pdl_wait(USE_PDL)
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
    is_q = h < NUM_HEADS
    if NORM:  # per-head RMSNorm before the rotation (Qwen3, Gemma 3: w, or 1 + w)
        rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        qw1 = tl.load(qn_ptr + d).to(tl.float32)
        qw2 = tl.load(qn_ptr + HALF + d).to(tl.float32)
        kw1 = tl.load(kn_ptr + d).to(tl.float32)
        kw2 = tl.load(kn_ptr + HALF + d).to(tl.float32)
        x1 = x1 * rms[:, None] * (tl.where(is_q, qw1, kw1) + NORM_OFFSET)
        x2 = x2 * rms[:, None] * (tl.where(is_q, qw2, kw2) + NORM_OFFSET)
    o1 = (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty)
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
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_offset: float = 0.0,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [N, (H + 2 Hkv) * D]; cos/sin [N, 1, D] (halves equal, as RotaryEmbedding gives them)
    -> rotated q [N, H, D] and k [N, Hkv, D], both new contiguous tensors. With `q_norm` and
    `k_norm` ([D] weights) each head is RMS-normalized first, scaled by (norm_offset + w).
    `pdl`: launch dependently (kernels/_triton.py)."""
    n = qkv.shape[0]
    norm = q_norm is not None
    if head_dim & (head_dim - 1) or qkv.stride(1) != 1:
        return rotary_qk_torch(
            qkv, cos, sin, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, norm_offset
        )
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
        q_norm if norm else cos2,  # unread without NORM
        k_norm if norm else cos2,
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads),
        NORM=norm,
        NORM_OFFSET=norm_offset,
        num_warps=4,
        **pdl_launch(pdl),
    )
    return q, k


def rotary_qk_torch(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    from radix_runtime.worker.layers.rotary import apply_rope

    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].reshape(-1, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = _head_norm(q, q_norm, eps, norm_offset), _head_norm(k, k_norm, eps, norm_offset)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _head_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (w.float() + offset)).to(x.dtype)
