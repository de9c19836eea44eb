"""The torch-native attention backend: the CPU path and the reference other backends are tested against.

Per batch (`plan`) it turns the page table into flat pool locations per request. Per layer it
stores the new K/V, reads each request's whole sequence from the pool, and runs
`F.scaled_dot_product_attention` with GQA. Decode requests (one new token each) share one padded
SDPA call over one index_select of their keys (a plain view of the pool for a lone request whose
locations are one run); prefill chunks run one call each with a causal mask shifted by their
cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from radix_runtime.worker.attention.base import AttentionBackend, AttentionMetadata
from radix_runtime.worker.kv_pool import KVPool


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [Bd] int64: the token row of each decode request
    kv_locs: torch.Tensor  # [Bd * max_len] int64, padded with location 0 (the reserved page)
    mask: torch.Tensor | None  # [Bd, 1, 1, max_len] bool: True where the key is real; None: all
    max_len: int
    all_rows: bool  # the batch is these decode rows and nothing else, in order
    span: tuple[int, int] | None  # one request whose keys are pool locations [a, b): a view


@dataclass
class _PrefillChunk:
    start: int  # token rows [start, end) of the batch
    end: int
    kv_locs: torch.Tensor  # [seq_len] int64
    mask: torch.Tensor | None  # [n, seq_len] bool, None when there is no cached prefix
    span: tuple[int, int] | None  # the keys are pool locations [a, b): read as a view


def sequence_locations(meta: AttentionMetadata, i: int) -> np.ndarray:
    """Flat pool locations of positions [0, seq_len) of request i."""
    ps = meta.page_size
    pages = meta.kv_page_indices_cpu[meta.kv_indptr_cpu[i] : meta.kv_indptr_cpu[i + 1]]
    locs = (pages.astype(np.int64)[:, None] * ps + np.arange(ps)).reshape(-1)
    return locs[: meta.seq_lens_cpu[i]]


def contiguous_span(locs: np.ndarray) -> tuple[int, int] | None:
    """(a, b) when `locs` is the run a, a+1, ..., b-1, else None."""
    if len(locs) and int(locs[-1]) - int(locs[0]) == len(locs) - 1 and np.all(np.diff(locs) == 1):
        return int(locs[0]), int(locs[-1]) + 1
    return None


def shifted_causal_mask(prefix_len: int, n: int, device: torch.device) -> torch.Tensor:
    """[n, prefix_len + n]: query j (at position prefix_len + j) sees keys at positions <= its own."""
    q_pos = torch.arange(n, device=device)[:, None] + prefix_len
    k_pos = torch.arange(prefix_len + n, device=device)[None, :]
    return k_pos <= q_pos


# cuDNN attention builds a plan per new shape, and decode changes the KV length every step
_SDPA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchNativeBackend(AttentionBackend):
    name = "torch"

    def plan(self, meta: AttentionMetadata) -> None:
        qo_lens = meta.qo_lens_cpu
        decode_ids = np.flatnonzero(qo_lens == 1)
        self._decode = self._plan_decode(meta, decode_ids) if len(decode_ids) else None
        self._prefills = [self._plan_prefill(meta, int(i)) for i in np.flatnonzero(qo_lens > 1)]
        self._out_cache_loc = meta.out_cache_loc

    def _plan_decode(self, meta: AttentionMetadata, ids: np.ndarray) -> _DecodeGroup:
        """The keys of all decode requests are read once per layer: a view of the pool when
        there is one request whose locations are one run (page_size 1 hands out runs), else one
        index_select of every request's locations, padded to the longest."""
        lens = meta.seq_lens_cpu[ids]
        max_len = int(lens.max())
        locs = np.zeros((len(ids), max_len), dtype=np.int64)
        for row, i in enumerate(ids):
            locs[row, : lens[row]] = sequence_locations(meta, int(i))
        span = contiguous_span(locs[0]) if len(ids) == 1 else None
        mask = None
        if (lens != max_len).any():
            mask = np.arange(max_len)[None, :] < lens[:, None]
            mask = torch.from_numpy(mask[:, None, None, :]).to(self.device)
        return _DecodeGroup(
            rows=torch.from_numpy(meta.qo_indptr_cpu[ids].astype(np.int64)).to(self.device),
            kv_locs=torch.from_numpy(locs.reshape(-1)).to(self.device),
            mask=mask,
            max_len=max_len,
            all_rows=len(ids) == meta.num_tokens,
            span=span,
        )

    def _plan_prefill(self, meta: AttentionMetadata, i: int) -> _PrefillChunk:
        start, end = int(meta.qo_indptr_cpu[i]), int(meta.qo_indptr_cpu[i + 1])
        prefix = int(meta.prefix_lens_cpu[i])
        mask = shifted_causal_mask(prefix, end - start, self.device) if prefix else None
        locs = sequence_locations(meta, i)
        return _PrefillChunk(
            start, end, torch.from_numpy(locs).to(self.device), mask, contiguous_span(locs)
        )

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        kv_pool.store(layer_id, self._out_cache_loc, k, v)
        k_all, v_all = kv_pool.k_flat(layer_id), kv_pool.v_flat(layer_id)
        if self._decode is not None and self._decode.all_rows:  # a decode-only batch
            return self._decode_attention(q, k_all, v_all)
        out = torch.empty_like(q)
        if self._decode is not None:
            out[self._decode.rows] = self._decode_attention(q[self._decode.rows], k_all, v_all)
        for c in self._prefills:
            q_c = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            mask = c.mask[None, None] if c.mask is not None else None
            if c.span is not None:
                k_c, v_c = k_all[c.span[0] : c.span[1]], v_all[c.span[0] : c.span[1]]
            else:
                k_c, v_c = k_all.index_select(0, c.kv_locs), v_all.index_select(0, c.kv_locs)
            k_c, v_c = k_c.unsqueeze(0), v_c.unsqueeze(0)
            out_c = self._sdpa(q_c, k_c, v_c, mask, causal=mask is None)
            out[c.start : c.end] = out_c[0].transpose(0, 1)
        return out

    def _decode_attention(
        self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor
    ) -> torch.Tensor:
        """q [Bd, H, D] of the decode rows -> their attention output [Bd, H, D]."""
        d = self._decode
        if d.span is not None:
            a, b = d.span
            k, v = k_all[a:b].unsqueeze(0), v_all[a:b].unsqueeze(0)
        else:
            shape = (q.shape[0], d.max_len, *k_all.shape[1:])
            k = k_all.index_select(0, d.kv_locs).view(shape)
            v = v_all.index_select(0, d.kv_locs).view(shape)
        # one query per request sees every key: not causal, masked only where keys are padding
        return self._sdpa(q.unsqueeze(2), k, v, d.mask, causal=False).squeeze(2)

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """q [B, H, n, D]; k/v [B, L, Hkv, D] as read from the pool."""
        k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
        with sdpa_kernel(_SDPA_KERNELS):
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=causal,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
