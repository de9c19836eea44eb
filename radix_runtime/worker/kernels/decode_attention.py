"""Decode attention for small batches: split-KV "flash decoding" in two Triton kernels, and the
torch reference.

At batch 1 FlashInfer's decode is ~9 us of attention plus ~2.5 us of its merge pass per layer
for 1K tokens, most of it fixed cost: a layer's whole KV is 4 MB (1 us at the copy rate).
Here each (request, KV head, split) program reads its share of the pages once for all the query
heads of its group (GQA: one tensor-core product for the group), and a second small kernel
merges the splits by their log-sum-exp. The FlashInfer backend uses it for decode-only batches
of <= `KernelConfig.triton_decode_max_bs` requests (FlashInfer's kernels are better at larger
batches, where splitting is not needed).
"""

from __future__ import annotations

import torch

from radix_runtime.worker.kernels._triton import pdl_launch, pdl_wait, tl, triton


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    last_len_ptr,
    part_o_ptr,
    part_lse_ptr,
    scale,
    v_scale,
    window,
    PAGE: tl.constexpr,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p0 = tl.load(kv_indptr_ptr + b)
    p1 = tl.load(kv_indptr_ptr + b + 1)
    seq = (p1 - p0 - 1) * PAGE + tl.load(last_len_ptr + b)
    # a sliding window (window > 0) reads only the last `window` keys
    lo = tl.where(window > 0, tl.maximum(seq - window, 0), 0)
    chunk = tl.cdiv(tl.cdiv(seq - lo, SPLITS), BLOCK_T) * BLOCK_T
    t0 = lo + s * chunk
    t1 = tl.minimum(t0 + chunk, seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    heads = h * GROUP + g  # the query heads served by KV head h
    g_ok = g < GROUP
    q = tl.load(q_ptr + (b * HKV * GROUP + heads)[:, None] * D + d[None, :], mask=g_ok[:, None],
                other=0.0)  # fmt: skip
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    den = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D), tl.float32)
    for t in range(t0, t1, BLOCK_T):
        tt = t + tl.arange(0, BLOCK_T)
        ok = tt < t1
        page = tl.load(kv_indices_ptr + p0 + tt // PAGE, mask=ok, other=0).to(tl.int64)
        off = ((page * PAGE + tt % PAGE) * HKV + h)[:, None] * D + d[None, :]
        # an FP8 pool is widened to q's dtype here (its K scale is folded into `scale`, its V
        # scale applied to the output)
        k = tl.load(k_ptr + off, mask=ok[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_ptr + off, mask=ok[:, None], other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k)) * scale
        qk = tl.where(ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    some = den > 0  # an empty split (short sequence) contributes nothing to the merge
    lse = tl.where(some, m + tl.log(tl.where(some, den, 1.0)), float("-inf"))
    out = acc * v_scale / tl.where(some, den, 1.0)[:, None]
    row = (b * HKV * GROUP + heads) * SPLITS + s
    tl.store(part_o_ptr + row[:, None] * D + d[None, :], out, mask=g_ok[:, None])
    tl.store(part_lse_ptr + row, lse, mask=g_ok)


@triton.jit
def _decode_merge_kernel(part_o_ptr, part_lse_ptr, out_ptr, D: tl.constexpr,
                         SPLITS: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # (request, query head)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    lse = tl.load(part_lse_ptr + row * SPLITS + s)
    w = tl.exp(lse - tl.max(lse, axis=0))  # every row has >= 1 token, so one split is finite
    o = tl.load(part_o_ptr + (row * SPLITS + s)[:, None] * D + d[None, :])
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty))


def decode_splits(batch_size: int, num_kv_heads: int) -> int:
    """Splits per (request, KV head): ~256 programs in all (two waves of 132 SMs), 1-32."""
    target = max(1, 256 // max(1, batch_size * num_kv_heads))
    return min(32, 1 << (target.bit_length() - 1))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    scale: float,
    splits: int | None = None,
    window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    pdl: bool = False,
    block_t: int = 32,
    warps: int = 4,
) -> torch.Tensor:
    """One new token per request over its paged KV. q [B, H, D]; k_cache/v_cache one layer's
    pool [pages, page_size, Hkv, D] (q's dtype, or FP8 read as value * k_scale / v_scale);
    kv_indptr [B + 1] / kv_indices (page ids) / last_page_len [B] int32 on the device, as
    FlashInfer takes them; `window` > 0: only each request's last `window` keys. Returns
    [B, H, D] in q's dtype. `pdl`: launch both kernels dependently (kernels/_triton.py);
    `block_t` / `warps`: the split kernel's keys per step and warps."""
    bsz, heads, dim = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = heads // hkv
    splits = splits or decode_splits(bsz, hkv)
    part_o = torch.empty((bsz * heads * splits, dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty(bsz * heads * splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    _decode_split_kernel[(bsz, hkv, splits)](
        q.contiguous(), k_cache, v_cache, kv_indptr, kv_indices, last_page_len, part_o, part_lse,
        scale * k_scale, v_scale, window, PAGE=page, HKV=hkv, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=dim, SPLITS=splits, BLOCK_T=block_t, num_warps=warps, **pdl_launch(pdl),
    )  # fmt: skip
    _decode_merge_kernel[(bsz * heads,)](part_o, part_lse, out, D=dim, SPLITS=splits, num_warps=4,
                                         **pdl_launch(pdl))  # fmt: skip
    return out


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    scale: float,
    window: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The reference, one request at a time, in float32."""
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        pages = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        seq = (len(pages) - 1) * page + int(last_page_len[b])
        k = k_cache[pages].reshape(-1, hkv, q.shape[2])[:seq].float() * k_scale
        v = v_cache[pages].reshape(-1, hkv, q.shape[2])[:seq].float() * v_scale
        if window:
            k, v = k[-window:], v[-window:]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [T, H, D]
        w = torch.softmax(torch.einsum("hd,thd->ht", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", w, v).to(q.dtype)
    return out
