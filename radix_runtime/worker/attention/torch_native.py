"""The torch-native attention backend: the CPU path and the reference other backends are tested against.

Per batch (`plan`) it turns the page table into flat pool locations per request. Per layer it
stores the new K/V, gathers each request's whole sequence from the pool, and runs
`F.scaled_dot_product_attention` with GQA. Decode requests (one new token each) share one padded
SDPA call; prefill chunks run one call each with a causal mask shifted by their cached prefix.

Sliding-window layers (a window of W keys: a query at position p sees positions > p - W) get a
plan of their own: only the keys inside some query's window are gathered, so cached K/V
outside the window are never read, and the mask cuts the rest.
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
    rows: torch.Tensor | None  # [Bd] int64: the token row of each decode request; None: all rows
    kv_locs: torch.Tensor  # [Bd * max_len] int64, padded with location 0 (the reserved page)
    shape: tuple[int, int]  # (Bd, max_len)
    mask: torch.Tensor | None  # [Bd, 1, 1, max_len] bool: True where the key is real; None: all
    span: tuple[int, int] | None = None  # a lone request's keys at pool locations [a, b): a view

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """[Bd, max_len, Hkv, D] from a layer's [locations, Hkv, D] pool: one index_select for
        the whole group (a view of the pool when a lone request's keys sit in a run of pages)."""
        if self.span is not None:
            return flat[self.span[0] : self.span[1]].unsqueeze(0)
        return flat.index_select(0, self.kv_locs).view(*self.shape, *flat.shape[1:])


@dataclass
class _PrefillChunk:
    start: int  # token rows [start, end) of the batch
    end: int
    kv_locs: torch.Tensor  # [seq_len] int64
    mask: torch.Tensor | None  # [n, seq_len] bool, None when there is no cached prefix
    span: tuple[int, int] | None = None  # the keys at pool locations [a, b): a view, no gather

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """[1, seq_len, Hkv, D] from a layer's [locations, Hkv, D] pool."""
        if self.span is not None:
            return flat[self.span[0] : self.span[1]].unsqueeze(0)
        return flat.index_select(0, self.kv_locs).unsqueeze(0)


def _span(locs: np.ndarray) -> tuple[int, int] | None:
    """[a, b) when `locs` are the consecutive pool locations a..b-1 (then a slice of the pool
    holds the same values, in the same layout, as an index_select of them), else None."""
    if len(locs) and (len(locs) == 1 or (np.diff(locs) == 1).all()):
        return int(locs[0]), int(locs[-1]) + 1
    return None


def sequence_locations(meta: AttentionMetadata, i: int) -> np.ndarray:
    """Flat pool locations of positions [0, seq_len) of request i."""
    ps = meta.page_size
    pages = meta.kv_page_indices_cpu[meta.kv_indptr_cpu[i] : meta.kv_indptr_cpu[i + 1]]
    locs = (pages.astype(np.int64)[:, None] * ps + np.arange(ps)).reshape(-1)
    return locs[: meta.seq_lens_cpu[i]]


def shifted_causal_mask(prefix_len: int, n: int, device: torch.device) -> torch.Tensor:
    """[n, prefix_len + n]: query j (at position prefix_len + j) sees keys at positions <= its own."""
    q_pos = torch.arange(n, device=device)[:, None] + prefix_len
    k_pos = torch.arange(prefix_len + n, device=device)[None, :]
    return k_pos <= q_pos


def windowed_causal_mask(
    prefix_len: int, n: int, first: int, window: int, device: torch.device
) -> torch.Tensor:
    """[n, prefix_len + n - first]: query j (position prefix_len + j) sees the keys at positions
    p - window < k <= p, where the keys gathered start at position `first`."""
    q_pos = torch.arange(n, device=device)[:, None] + prefix_len
    k_pos = torch.arange(first, prefix_len + n, device=device)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


# cuDNN attention builds a plan per new shape, and decode changes the KV length every step
_SDPA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchNativeBackend(AttentionBackend):
    name = "torch"
    _read: tuple[KVPool, int] | None = None  # (FP8 pool, layer) being read in this forward

    def plan(self, meta: AttentionMetadata) -> None:
        qo_lens = meta.qo_lens_cpu
        decode_ids = np.flatnonzero(qo_lens == 1)
        # per window (0 = full): the decode group and the prefill chunks
        self._plans: dict[int, tuple[_DecodeGroup | None, list[_PrefillChunk]]] = {}
        for w in self.windows():
            decode = self._plan_decode(meta, decode_ids, w) if len(decode_ids) else None
            prefills = [self._plan_prefill(meta, int(i), w) for i in np.flatnonzero(qo_lens > 1)]
            self._plans[w] = (decode, prefills)
        self._out_cache_loc = meta.out_cache_loc

    def _plan_decode(self, meta: AttentionMetadata, ids: np.ndarray, window: int) -> _DecodeGroup:
        lens = meta.seq_lens_cpu[ids]
        if window:
            lens = np.minimum(lens, window)  # the last `window` keys of each
        locs = np.zeros((len(ids), int(lens.max())), dtype=np.int64)
        for row, i in enumerate(ids):
            locs[row, : lens[row]] = sequence_locations(meta, int(i))[-int(lens[row]) :]
        padded = bool((lens < locs.shape[1]).any())
        mask = np.arange(locs.shape[1])[None, :] < lens[:, None]
        every_row = len(ids) == meta.num_tokens  # a decode-only batch: rows 0..Bd-1 in order
        return _DecodeGroup(
            rows=None
            if every_row
            else torch.from_numpy(meta.qo_indptr_cpu[ids].astype(np.int64)).to(self.device),
            kv_locs=torch.from_numpy(locs.reshape(-1)).to(self.device),
            shape=locs.shape,
            mask=torch.from_numpy(mask[:, None, None, :]).to(self.device) if padded else None,
            span=_span(locs[0]) if len(ids) == 1 else None,
        )

    def _plan_prefill(self, meta: AttentionMetadata, i: int, window: int = 0) -> _PrefillChunk:
        start, end = int(meta.qo_indptr_cpu[i]), int(meta.qo_indptr_cpu[i + 1])
        prefix = int(meta.prefix_lens_cpu[i])
        if window and prefix + end - start > window:
            first = max(0, prefix - window + 1)  # the first key the chunk's first query sees
            mask = windowed_causal_mask(prefix, end - start, first, window, self.device)
            locs = sequence_locations(meta, i)[first:]
        else:
            mask = shifted_causal_mask(prefix, end - start, self.device) if prefix else None
            locs = sequence_locations(meta, i)
        # a chunk whose keys sit in one run of pages (a fresh prompt, a cached turn that got the
        # pages after its prefix's) reads a view of the pool instead of copying it every layer
        span = _span(locs)
        kv_locs = torch.from_numpy(locs).to(self.device)
        return _PrefillChunk(start, end, kv_locs, mask, span)

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        if self.kv_waits is not None:  # the host tier's loads of this layer's pages
            self.kv_waits.before(layer_id)
        kv_pool.store(layer_id, self._out_cache_loc, k, v)
        k_all, v_all = kv_pool.k_flat(layer_id), kv_pool.v_flat(layer_id)
        # an FP8 pool is read back through its scales (`_sdpa` dequantizes what it gathered)
        self._read = (kv_pool, layer_id) if kv_pool.is_fp8 else None
        decode, prefills = self._plans[self.window(layer_id)]
        if decode is not None and decode.rows is None:  # decode only: no scatter into `out`
            d = decode
            return self._sdpa(
                q.unsqueeze(2), d.gather(k_all), d.gather(v_all), d.mask, causal=False
            ).squeeze(2)
        out = torch.empty_like(q)
        if decode is not None:
            d = decode
            out[d.rows] = self._sdpa(
                q[d.rows].unsqueeze(2), d.gather(k_all), d.gather(v_all), d.mask, causal=False
            ).squeeze(2)
        for c in prefills:
            q_c = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            mask = c.mask[None, None] if c.mask is not None else None
            k_c, v_c = c.gather(k_all), c.gather(v_all)
            out[c.start : c.end] = self._sdpa(q_c, k_c, v_c, mask)[0].transpose(0, 1)
        return out

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool = True,
    ) -> torch.Tensor:
        """q [B, H, n, D]; k/v [B, L, Hkv, D] as gathered from the pool. Without a mask: causal
        (prefill) or every key (`causal=False`: decode rows whose keys need no padding)."""
        if self._read is not None:
            k, v = self._read[0].dequantize(self._read[1], k, v)
        k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
        kwargs = dict(
            attn_mask=mask,
            is_causal=mask is None and causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        if q.device.type == "cpu":  # no cuDNN to keep out; the context costs ~30 us a layer
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        with sdpa_kernel(_SDPA_KERNELS):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
