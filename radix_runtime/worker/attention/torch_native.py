"""The torch-native attention backend: the CPU path and the reference other backends are tested against.

Per batch (`plan`) it turns the page table into flat pool locations per request. Per layer it
stores the new K/V, gathers each request's whole sequence from the pool, and runs
`F.scaled_dot_product_attention` with GQA. Decode requests (one new token each) share one padded
SDPA call; prefill chunks run one call each with a causal mask shifted by their cached prefix.

On the CPU, a small prefill chunk with a cached prefix (a chat's next turn: a few new tokens
over a long history) runs, in float32 with the `_cpu_decoder` extension built, as a C++ kernel
that reads its keys through their pool locations (`_PrefillChunk.row_prefix`,
csrc/cpu_decoder.cpp `chunk_attention`: no gathered copy, work split evenly over both threads,
each query row's result independent of the other rows). Otherwise (bfloat16, an FP8 pool, no
extension) it runs grouped-query attention as plain attention over G*n query rows per KV head
(the G query heads of a KV head stacked, with the chunk's mask repeated and made additive once
per step): one SDPA work item per KV head instead of per query head, and bitwise the same
outputs (`_PrefillChunk.grouped`).

Sliding-window layers (a window of W keys: a query at position p sees positions > p - W) get a
plan of their own: only the keys inside some query's window are gathered, so cached K/V
outside the window are never read, and the mask cuts the rest.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

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


@functools.cache
def _extension():
    """The `_cpu_decoder` extension, or None when it is not built."""
    from radix_runtime.worker import cpu_native  # (it imports this module)

    return cpu_native.load_extension()


def _cpu_kernels(q: torch.Tensor, k_all: torch.Tensor):
    """The extension when its attention kernels apply (float32 on the CPU), else None."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_all.dtype != torch.float32:
        return None
    return _extension()


def _row_attention(q: torch.Tensor, k_all: torch.Tensor):
    """The C++ row loop a decode step's attention runs as (float32 on the CPU, with the
    `_cpu_decoder` extension built; ATen's flash SDPA costs ~30-55 us a layer for one query),
    else None."""
    ext = _cpu_kernels(q, k_all)
    return ext.decode_attention if ext is not None else None


def _chunk_rows(q: torch.Tensor, k_all: torch.Tensor):
    """The C++ kernel a small chunk over a cached prefix runs as (float32 on the CPU, with the
    `_cpu_decoder` extension built: ~3x less time than the flash SDPA over a gathered copy of
    the keys for 9 rows over ~900 keys), else None."""
    ext = _cpu_kernels(q, k_all)
    return ext.chunk_attention if ext is not None else None


# a prefill chunk with a mask whose query heads, stacked per KV head, make at most this many rows
# runs grouped (`_PrefillChunk.grouped`); past it the [G*n, seq_len] mask grows and the flash
# kernel's own blocking over n rows gains nothing from it (measured: 9 and 20 new tokens over ~950
# keys gain 22% and 8%)
GROUPED_QUERY_ROWS = 64


@dataclass
class _PrefillChunk:
    start: int  # token rows [start, end) of the batch
    end: int
    kv_locs: torch.Tensor  # [seq_len] int64
    # [n, seq_len] bool, None when there is no cached prefix; a grouped chunk's is [G*n, seq_len]
    # (row g*n + j: query j of the KV head's g-th query head)
    mask: torch.Tensor | None
    span: tuple[int, int] | None = None  # the keys at pool locations [a, b): a view, no gather
    grouped: int = 0  # G > 0: the queries run as [1, Hkv, G*n, D] against their KV heads
    # >= 0: a small chunk over this many cached keys; float32 on the CPU it runs as the C++ row
    # kernel (csrc/cpu_decoder.cpp chunk_attention: keys read through kv_locs, no gather)
    row_prefix: int = -1
    _additive: dict = field(default_factory=dict)  # dtype -> the mask as 0 / -inf (grouped)

    def attn_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as SDPA takes it ([rows, seq_len]): bool, or for a grouped chunk additive in
        the queries' dtype, made once per step (the flash kernel would convert it every layer)."""
        if not self.grouped or self.mask is None:
            return self.mask
        additive = self._additive.get(dtype)
        if additive is None:
            additive = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            additive.masked_fill_(~self.mask, float("-inf"))
            self._additive[dtype] = additive
        return additive

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
        window_cut = bool(window and prefix + end - start > window)
        if window_cut:
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
        # (the CPU's flash kernel: measured there; CUDA keeps its kernels' per-head calls)
        group = self.num_heads // self.num_kv_heads
        grouped = 0
        small = group * (end - start) <= GROUPED_QUERY_ROWS
        if mask is not None and group > 1 and small and self.device.type == "cpu":
            grouped, mask = group, mask.repeat(group, 1)
        row_prefix = -1
        if mask is not None and not window_cut and small and self.device.type == "cpu":
            row_prefix = prefix
        return _PrefillChunk(start, end, kv_locs, mask, span, grouped, row_prefix)

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
        # an FP8 pool is read back through its scales (`_sdpa` dequantizes what it gathered)
        self._read = (kv_pool, layer_id) if kv_pool.is_fp8 else None
        decode, prefills = self._plans[self.window(layer_id)]
        if decode is not None and decode.rows is None:  # decode only: no scatter into `out`
            d = decode
            row_loop = _row_attention(q, k_all) if d.mask is None and self._read is None else None
            if row_loop is not None:
                # one query row per request over all of its keys: the C++ loop the native
                # decoder runs too (csrc/cpu_decoder.cpp decode_attention), bitwise the same
                return row_loop(q, d.gather(k_all), d.gather(v_all), self.scale)
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
            n = c.end - c.start
            rows = _chunk_rows(q, k_all) if c.row_prefix >= 0 and self._read is None else None
            if rows is not None:  # the C++ row kernel the native decoder runs too: same bits
                out[c.start : c.end] = rows(
                    q[c.start : c.end], k_all, v_all, c.kv_locs, c.row_prefix, self.scale
                )
                continue
            q_c = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            mask = c.attn_mask(q.dtype)
            mask = mask[None, None] if mask is not None else None
            k_c, v_c = c.gather(k_all), c.gather(v_all)
            if c.grouped:  # [1, Hkv, G*n, D]: a KV head's query heads one after the other
                q_c = q_c.reshape(1, self.num_kv_heads, c.grouped * n, q.shape[-1])
            o = self._sdpa(q_c, k_c, v_c, mask, gqa=not c.grouped)
            out[c.start : c.end] = o.reshape(self.num_heads, n, -1).transpose(0, 1)
        return out

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool = True,
        gqa: bool = True,
    ) -> torch.Tensor:
        """q [B, H, n, D]; k/v [B, L, Hkv, D] as gathered from the pool. Without a mask: causal
        (prefill) or every key (`causal=False`: decode rows whose keys need no padding).
        `gqa=False`: q already has one head per KV head (a grouped chunk's [1, Hkv, G*n, D])."""
        if self._read is not None:
            k, v = self._read[0].dequantize(self._read[1], k, v)
        k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
        kwargs = dict(
            attn_mask=mask,
            is_causal=mask is None and causal,
            scale=self.scale,
            enable_gqa=gqa and self.num_heads != self.num_kv_heads,
        )
        if q.device.type == "cpu":  # no cuDNN to keep out; the context costs ~30 us a layer
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        with sdpa_kernel(_SDPA_KERNELS):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
