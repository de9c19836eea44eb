"""The torch attention backend (worker/attention/torch_native.py): decode rows read with one
index_select per layer for the whole decode group, a view of the pool for a lone request whose
keys sit in a run of pages, no mask when no row is padded; a prefill chunk whose keys sit in a run
of pages reads a view too. Every case against a plain per-request reference (each request's keys
gathered by hand, softmax over all of them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radix_runtime.worker.attention.base import AttentionMetadata
from radix_runtime.worker.attention.torch_native import TorchNativeBackend
from radix_runtime.worker.kv_pool import KVPool

HEADS, KV_HEADS, DIM = 4, 2, 16


def metadata(pages: list[np.ndarray], qo_lens: list[int]) -> AttentionMetadata:
    """Page size 1: request i holds the keys at `pages[i]`, its last `qo_lens[i]` are new."""
    seq = np.array([len(p) for p in pages], np.int32)
    qo = np.array(qo_lens, np.int32)
    pre = seq - qo
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(seq)]).astype(np.int32)
    idx = np.concatenate(pages).astype(np.int32)
    positions = np.concatenate([np.arange(p, s) for p, s in zip(pre, seq)]).astype(np.int64)
    out_loc = np.concatenate([p[-n:] for p, n in zip(pages, qo_lens)]).astype(np.int64)

    def t(a, dtype=torch.int32):
        return torch.from_numpy(np.asarray(a)).to(dtype)

    return AttentionMetadata(
        page_size=1, num_tokens=int(qo.sum()), qo_indptr_cpu=qo_indptr, kv_indptr_cpu=kv_indptr,
        kv_page_indices_cpu=idx, kv_last_page_len_cpu=np.ones(len(pages), np.int32),
        prefix_lens_cpu=pre, seq_lens_cpu=seq, input_ids_cpu=np.zeros(int(qo.sum()), np.int64),
        positions_cpu=positions, out_cache_loc_cpu=out_loc, qo_indptr=t(qo_indptr),
        kv_indptr=t(kv_indptr), kv_page_indices=t(idx), kv_last_page_len=t(np.ones(len(pages))),
        seq_lens=t(seq), positions=t(positions, torch.long), out_cache_loc=t(out_loc, torch.long),
    )  # fmt: skip


def reference(q, pool, pages, qo_lens):
    """Each request's rows against its own keys (causal within its new rows), in float64."""
    k_all, v_all = pool.k_flat(0).double(), pool.v_flat(0).double()
    out, row = [], 0
    for p, n in zip(pages, qo_lens):
        k = k_all[torch.from_numpy(p.astype(np.int64))].repeat_interleave(HEADS // KV_HEADS, 1)
        v = v_all[torch.from_numpy(p.astype(np.int64))].repeat_interleave(HEADS // KV_HEADS, 1)
        qs = q[row : row + n].double()
        scores = torch.einsum("nhd,lhd->hnl", qs, k) / DIM**0.5
        q_pos = torch.arange(len(p) - n, len(p))[:, None]
        scores = scores.masked_fill(torch.arange(len(p))[None, :] > q_pos, float("-inf"))
        out.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v))
        row += n
    return torch.cat(out).float()


def planned_forward(pages, qo_lens, seed):
    """A one-layer pool of random K/V, the backend planned for `pages` / `qo_lens`, and its
    output for random q, k, v (stored at the new tokens' locations first)."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(1, 256, 1, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    pool.k_flat(0).copy_(torch.randn(pool.k_flat(0).shape, generator=gen))
    pool.v_flat(0).copy_(torch.randn(pool.v_flat(0).shape, generator=gen))
    backend = TorchNativeBackend(HEADS, KV_HEADS, DIM, torch.device("cpu"))
    backend.plan(metadata(pages, qo_lens))
    n = sum(qo_lens)
    q = torch.randn(n, HEADS, DIM, generator=gen)
    k = torch.randn(n, KV_HEADS, DIM, generator=gen)
    v = torch.randn(n, KV_HEADS, DIM, generator=gen)
    return backend, pool, q, backend.forward(0, q, k, v, pool)


CASES = {
    "lone request, a run of pages (a view)": ([np.arange(5, 45)], [1], True),
    "lone request, scattered pages": ([np.r_[7:20, 60:80, 3]], [1], False),
    "decode batch, unequal lengths (padded)": ([np.arange(5, 45), np.arange(100, 112)], [1, 1], None),
    "decode rows beside a prefill chunk": ([np.arange(5, 45), np.arange(100, 130)], [1, 6], None),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_decode_rows_match_a_per_request_reference(case):
    pages, qo_lens, viewed = CASES[case]
    backend, pool, q, out = planned_forward(pages, qo_lens, seed=0)
    torch.testing.assert_close(out, reference(q, pool, pages, qo_lens), rtol=1e-5, atol=1e-5)
    decode = backend._plans[0][0]
    if viewed is not None:
        assert (decode.span is not None) == viewed
    assert (decode.mask is None) == (
        len(set(len(p) for p, n in zip(pages, qo_lens) if n == 1)) == 1
    )


PREFILL_CASES = {
    "fresh prompt in a run of pages (a view)": ([np.arange(10, 40)], [30], True),
    "cached prefix, new tokens right after it (a view)": ([np.arange(10, 40)], [6], True),
    "cached prefix, new tokens on other pages": ([np.r_[10:34, 90:96]], [6], False),
    "two chunks, one viewed": ([np.arange(10, 40), np.r_[50:60, 70:75]], [8, 5], None),
}  # fmt: skip


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_chunks_match_a_per_request_reference(case):
    pages, qo_lens, viewed = PREFILL_CASES[case]
    backend, pool, q, out = planned_forward(pages, qo_lens, seed=1)
    torch.testing.assert_close(out, reference(q, pool, pages, qo_lens), rtol=1e-5, atol=1e-5)
    chunks = backend._plans[0][1]
    spans = [c.span is not None for c in chunks]
    assert spans == ([viewed] if viewed is not None else [True, False])
    for c, p in zip(chunks, pages):
        if c.span is not None:
            assert c.span == (int(p[0]), int(p[-1]) + 1)
        # the view holds exactly what an index_select of the locations would
        assert torch.equal(c.gather(pool.k_flat(0)), pool.k_flat(0)[c.kv_locs].unsqueeze(0))


GROUPING_CASES = {
    # (pages, qo_lens, G per chunk): G = HEADS // KV_HEADS = 2 where G * n <= GROUPED_QUERY_ROWS
    "cached prefix, a few new tokens": ([np.arange(10, 40)], [6], [2]),
    "cached prefix, new tokens on other pages": ([np.r_[10:34, 90:96]], [6], [2]),
    "fresh prompt (causal, no mask)": ([np.arange(10, 40)], [30], [0]),
    "cached prefix, too many new tokens": ([np.arange(10, 80)], [33], [0]),
    "two chunks": ([np.arange(10, 40), np.r_[50:60, 70:75]], [8, 5], [2, 2]),
}  # fmt: skip


@pytest.mark.parametrize("case", GROUPING_CASES)
def test_small_chunks_over_a_cached_prefix_run_their_query_heads_grouped(case, monkeypatch):
    """A KV head's query heads as G*n rows of one SDPA (no enable_gqa), with the mask repeated
    per query head and additive: the same outputs, bitwise, as the per-query-head SDPA."""
    from radix_runtime.worker.attention import torch_native

    pages, qo_lens, groups = GROUPING_CASES[case]
    # the SDPA path such chunks take where the C++ row kernel does not apply (bf16, FP8 pools,
    # no extension): float32 here, so the kernel is turned off
    monkeypatch.setattr(torch_native, "_chunk_rows", lambda q, k_all: None)
    calls = []
    sdpa = torch_native.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((tuple(q.shape), kw["enable_gqa"], kw["attn_mask"]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch_native.F, "scaled_dot_product_attention", spy)
    backend, pool, q, out = planned_forward(pages, qo_lens, seed=2)
    torch.testing.assert_close(out, reference(q, pool, pages, qo_lens), rtol=1e-5, atol=1e-5)
    chunks = backend._plans[0][1]
    assert [c.grouped for c in chunks] == groups
    for (shape, gqa, mask), c, n in zip(calls, chunks, qo_lens):
        if c.grouped:
            assert shape == (1, KV_HEADS, c.grouped * n, DIM) and not gqa
            assert mask.dtype == torch.float32 and mask.shape[-2] == c.grouped * n
        else:
            assert shape == (1, HEADS, n, DIM) and gqa
    # the per-query-head path (grouping off) computes the very same numbers
    monkeypatch.setattr(torch_native, "GROUPED_QUERY_ROWS", 0)
    ungrouped = planned_forward(pages, qo_lens, seed=2)
    assert not any(c.grouped for c in ungrouped[0]._plans[0][1])
    assert torch.equal(out, ungrouped[3])


def test_chunks_off_the_cpu_keep_their_per_head_calls():
    """Grouping was measured on the CPU's flash kernel: another device plans per-head calls."""
    backend = TorchNativeBackend(HEADS, KV_HEADS, DIM, torch.device("meta"))
    backend.plan(metadata([np.arange(10, 40)], [6]))
    (chunk,) = backend._plans[0][1]
    assert chunk.grouped == 0 and chunk.mask.shape == (6, 30)


@pytest.mark.parametrize("case", GROUPING_CASES)
def test_small_float32_chunks_over_a_cached_prefix_run_the_row_kernel(case, monkeypatch):
    """With the `_cpu_decoder` extension, a small float32 chunk over a cached prefix runs
    `chunk_attention` (its keys read through the locations, no gather, no SDPA); the others
    keep SDPA. Both against the per-request reference."""
    from radix_runtime.worker import cpu_native
    from radix_runtime.worker.attention import torch_native

    ext = cpu_native.load_extension()
    if ext is None:
        pytest.skip("the _cpu_decoder extension is not built")
    pages, qo_lens, groups = GROUPING_CASES[case]
    kernel_calls, sdpa_calls = [], []
    sdpa = torch_native.F.scaled_dot_product_attention

    def rows(q, k_all, v_all, locs, prefix, scale):
        kernel_calls.append((q.shape[0], prefix))
        return ext.chunk_attention(q, k_all, v_all, locs, prefix, scale)

    monkeypatch.setattr(torch_native, "_chunk_rows", lambda q, k_all: rows)
    monkeypatch.setattr(
        torch_native.F,
        "scaled_dot_product_attention",
        lambda *a, **kw: sdpa_calls.append(1) or sdpa(*a, **kw),
    )
    backend, pool, q, out = planned_forward(pages, qo_lens, seed=2)
    torch.testing.assert_close(out, reference(q, pool, pages, qo_lens), rtol=1e-5, atol=1e-5)
    chunks = backend._plans[0][1]
    small = [g > 0 for g in groups]  # small and over a cached prefix (HEADS > KV_HEADS here)
    assert [c.row_prefix >= 0 for c in chunks] == small
    want = [(n, len(p) - n) for p, n, s in zip(pages, qo_lens, small) if s]
    assert kernel_calls == want
    assert len(sdpa_calls) == len(chunks) - len(want)
