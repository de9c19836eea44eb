"""The padding of prefill/mixed batches to captured CUDA-graph shapes (worker/cuda_graph.py),
checked on CPU with the torch backend: a padded batch gives every real row the hidden state it
gets unpadded, and padding writes K/V only into the reserved page 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.worker.cuda_graph import (
    extend_token_sizes,
    pad_extend_batch,
    pick_extend_shape,
)
from radix_runtime.worker.model_runner import ModelRunner

GREEDY = m.SamplingParams(temperature=0.0)


def test_token_sizes():
    assert extend_token_sizes(512) == [64, 128, 192, 256, 384, 512]
    assert extend_token_sizes(100) == [64, 100]
    assert extend_token_sizes(2048)[-3:] == [512, 1024, 2048]
    assert extend_token_sizes(0) == []


@pytest.mark.parametrize(
    "reqs,tokens,shape",
    [
        (1, 1, (1, 64)),
        (1, 256, (1, 256)),  # exact: no padding at all
        (2, 256, (2, 256)),
        (3, 100, (4, 128)),  # one padding request, 27 more tokens on it
        (3, 127, (4, 128)),
        (3, 128, (4, 192)),  # the padding request needs a token of its own
        (16, 512, (16, 512)),
        (17, 20, None),  # more requests than any shape
        (1, 513, None),
    ],
)
def test_pick_shape(reqs, tokens, shape):
    assert pick_extend_shape([1, 2, 4, 8, 16], extend_token_sizes(512), reqs, tokens) == shape


def test_pad_layout():
    # two real requests: 3 new tokens after 5 cached, and 2 new tokens; page size 4
    pad = pad_extend_batch(
        np.array([3, 2]), np.array([8, 2]), np.array([7, 8, 9, 10, 11]),
        np.array([5, 6, 7, 0, 1]), np.array([21, 22, 23, 40, 41]), 4, 10, 4,
    )  # fmt: skip
    # padding request 1: one token; padding request 2: one token + 3 extra at positions 1..3
    assert pad.qo_indptr.tolist() == [0, 3, 5, 6, 10]
    assert pad.positions.tolist() == [5, 6, 7, 0, 1, 0, 0, 1, 2, 3]
    assert pad.out_cache_loc.tolist() == [21, 22, 23, 40, 41, 0, 0, 1, 2, 3]
    assert pad.input_ids.tolist() == [7, 8, 9, 10, 11, 0, 0, 0, 0, 0]
    assert pad.kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert pad.kv_last_page_len.tolist() == [4, 2, 1, 4]
    assert pad.rows.tolist() == [2, 4, 5, 6]
    assert pad.num_pad_pages == 2
    # no padding request: the extra tokens extend the last real request
    pad = pad_extend_batch(
        np.array([2]), np.array([6]), np.array([1, 2]), np.array([4, 5]), np.array([9, 10]),
        1, 5, 4,
    )  # fmt: skip
    assert pad.qo_indptr.tolist() == [0, 5]
    assert pad.positions.tolist() == [4, 5, 6, 7, 8]
    assert pad.out_cache_loc.tolist() == [9, 10, 2, 3, 0]
    assert pad.kv_indptr.tolist() == [0, 3] and pad.kv_last_page_len.tolist() == [1]
    assert pad.rows.tolist() == [1] and pad.num_pad_pages == 1
    with pytest.raises(ValueError):
        pad_extend_batch(np.array([3]), np.array([3]), *[np.zeros(3, np.int64)] * 3, 2, 3, 1)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("shape", [(2, 40), (4, 64), (3, 30)])
def test_padded_batch_leaves_real_rows_unchanged(page_size, shape):
    runner = ModelRunner(
        ServerArgs(
            model="tiny-llama", load_format="dummy", device="cpu", max_total_tokens=1024,
            max_running_requests=8, page_size=page_size,
        )
    )  # fmt: skip
    rng = np.random.default_rng(0)
    ps = page_size
    # slot 0: 9 cached tokens, then a chunk of 6; slot 1: a fresh 5-token prompt; slot 2 (when
    # the shape has room): a decode after 4 tokens
    first = m.ForwardReq(
        slot=0, input_ids=m.pack_ids(rng.integers(1, 200, 9)), start_pos=0,
        new_pages=m.pack_ids(list(range(1, 1 + -(-9 // ps)))), new_slot=True, sampling=GREEDY,
    )  # fmt: skip
    third = m.ForwardReq(
        slot=2, input_ids=m.pack_ids(rng.integers(1, 200, 4)), start_pos=0,
        new_pages=m.pack_ids(list(range(80, 80 + -(-5 // ps)))), new_slot=True, sampling=GREEDY,
    )  # fmt: skip
    runner.forward(m.ForwardBatch(step=1, reqs=[first, third]))
    reqs = [
        m.ForwardReq(
            slot=0, input_ids=m.pack_ids(rng.integers(1, 200, 6)), start_pos=9,
            page_offset=-(-9 // ps),
            new_pages=m.pack_ids(list(range(40, 40 + -(-15 // ps) - -(-9 // ps)))),
        ),
        m.ForwardReq(
            slot=1, input_ids=m.pack_ids(rng.integers(1, 200, 5)), start_pos=0,
            new_pages=m.pack_ids(list(range(60, 65))), new_slot=True, sampling=GREEDY,
        ),
    ]  # fmt: skip
    bs, tokens = shape
    if bs >= 3:
        reqs.append(m.ForwardReq(slot=2, input_ids=m.pack_ids([7]), start_pos=4))
    with torch.inference_mode():
        layout = runner._prepare(reqs)
        meta = layout.meta
        runner.attn.plan(meta)
        pool = runner.kv_pool
        before = [b.clone() for b in pool.k_buffers]
        plain = runner.model(layout.input_ids, meta.positions, runner.attn, pool)
        after_plain = [b.clone() for b in pool.k_buffers]

        pad = pad_extend_batch(
            np.diff(meta.qo_indptr_cpu), meta.seq_lens_cpu, meta.input_ids_cpu,
            meta.positions_cpu, meta.out_cache_loc_cpu, bs, tokens, ps,
        )  # fmt: skip
        indices = np.concatenate([meta.kv_page_indices_cpu, np.zeros(pad.num_pad_pages, np.int32)])
        kv_indptr = pad.kv_indptr
        seq_lens = (np.diff(kv_indptr) - 1) * ps + pad.kv_last_page_len
        qo_lens = np.diff(pad.qo_indptr)
        rows = [indices[kv_indptr[i] : kv_indptr[i + 1]] for i in range(bs)]
        pmeta = runner._metadata(
            qo_lens, seq_lens - qo_lens, seq_lens, np.diff(kv_indptr), rows, pad.input_ids,
            pad.positions, pad.out_cache_loc,
        )  # fmt: skip
        for b, saved in zip(pool.k_buffers, before):
            b.copy_(saved)
        runner.attn.plan(pmeta)
        ids = torch.from_numpy(pad.input_ids)
        padded = runner.model(ids, pmeta.positions, runner.attn, pool)
    real_rows = pad.rows[: len(reqs)]
    torch.testing.assert_close(padded[real_rows], plain[meta.qo_indptr_cpu[1:] - 1])
    torch.testing.assert_close(padded[: meta.num_tokens], plain)
    for b, ref in zip(pool.k_buffers, after_plain):  # padding touched nothing but page 0
        torch.testing.assert_close(b[1:], ref[1:])
