"""Decode through CUDA graphs (padded to the captured sizes) against the same runner without them."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("flashinfer")

from gpu_support import copy_weights, cuda_runner, greedy_agrees, random_ids, rel_err  # noqa: E402
from model_support import Driver, Seq  # noqa: E402

from radix_runtime.worker.cuda_graph import capture_batch_sizes  # noqa: E402


def test_capture_sizes():
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    sizes = capture_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and sizes == sorted(set(sizes))


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_decode_matches_eager(page_size):
    graphs = cuda_runner(page_size=page_size)
    eager = cuda_runner(page_size=page_size, disable_cuda_graph=True)
    assert graphs.cuda_graphs is not None and eager.cuda_graphs is None
    assert graphs.cuda_graphs.batch_sizes == [1, 2, 4, 8]
    copy_weights(eager, graphs)
    d = Driver([graphs, eager])
    seqs = [Seq(slot=i) for i in range(10)]
    tokens = []
    for i, s in enumerate(seqs):  # prompts of different lengths, some crossing page boundaries
        (res, _), _ = d.step([d.req(s, random_ids(5 + 7 * i, i))])
        tokens.append(res[0].next_id)

    # batch sizes 5 (padded to 8), 1, 3 (padded to 4), 8 (exact), 10 (beyond the largest graph:
    # eager in both); decode tokens from the eager runner feed both
    for batch in [range(5), range(5), [2], range(3, 6), range(8), range(10), range(5)]:
        outs = d.step([d.req(seqs[i], [tokens[i]], prompt_logprobs=False) for i in batch])
        (g_res, g_logits), (e_res, e_logits) = outs
        for j, i in enumerate(batch):
            assert rel_err(g_logits[j], e_logits[j]) < 1e-2
            assert greedy_agrees(g_logits[j], e_logits[j], 0.05)
            if g_res[j].next_id != e_res[j].next_id:  # only a near-tie may differ
                top2 = e_logits[j][0].topk(2).values
                assert top2[0] - top2[1] < 0.05
            tokens[i] = e_res[j].next_id


def test_one_token_chunk_that_samples_nothing():
    """A decode-shaped batch where one request is a non-final 1-token prefill chunk."""
    graphs = cuda_runner()
    eager = cuda_runner(disable_cuda_graph=True)
    copy_weights(eager, graphs)
    d = Driver([graphs, eager])
    a, b = Seq(slot=0), Seq(slot=1)
    d.step([d.req(a, random_ids(9, 0), prompt_logprobs=False)])
    d.step([d.req(b, random_ids(1, 1), sample=False, prompt_logprobs=False)])
    outs = d.step(
        [
            d.req(a, [5], prompt_logprobs=False),
            d.req(b, [6], sample=False, prompt_logprobs=False),
        ]
    )
    (g_res, g_logits), (e_res, e_logits) = outs
    assert g_logits[1] is None and g_res[1].next_id == -1
    assert rel_err(g_logits[0], e_logits[0]) < 1e-2


def _check_rows(outs, slack: float = 0.05) -> None:
    (g_res, g_logits), (e_res, e_logits) = outs
    for j in range(len(g_res)):
        assert (g_logits[j] is None) == (e_logits[j] is None)
        if e_logits[j] is None:
            assert g_res[j].next_id == e_res[j].next_id == -1
            continue
        assert rel_err(g_logits[j], e_logits[j]) < 1e-2
        assert greedy_agrees(g_logits[j], e_logits[j], slack)


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_graphs_match_eager(page_size):
    """Prefill and mixed batches replayed in the captured (requests, tokens) shapes, padded with
    padding requests and extra tokens, against the eager runner."""
    graphs = cuda_runner(page_size=page_size, cuda_graph_max_extend_tokens=256)
    eager = cuda_runner(page_size=page_size, disable_cuda_graph=True)
    assert eager.extend_graphs is None
    ext = graphs.extend_graphs
    assert ext.token_sizes == [64, 128, 192, 256] and ext.req_sizes == [1, 2, 4, 8, 16]
    copy_weights(eager, graphs)
    d = Driver([graphs, eager])
    a, b, c, e = Seq(slot=0), Seq(slot=1), Seq(slot=2), Seq(slot=3)
    replays = ext.replays

    def step(reqs, graphed: bool):
        nonlocal replays
        outs = d.step(reqs)
        _check_rows(outs)
        replays += graphed
        assert ext.replays == replays, "the batch did not take the expected path"
        return outs[1][0]

    # one fresh prompt of exactly 64 tokens (no padding), then one of 37 (27 extra tokens)
    step([d.req(a, random_ids(64, 1), prompt_logprobs=False)], True)
    step([d.req(b, random_ids(37, 2), prompt_logprobs=False)], True)
    # a prefix hit: c starts with a's first 48 tokens cached, then a chunk that samples nothing
    d.share_prefix(c, a, 48)
    step([d.req(c, random_ids(20, 3), sample=False, prompt_logprobs=False)], True)
    # mixed: two decodes, c's last chunk, a fresh prompt (4 requests, padded to 128 tokens)
    res = step(
        [
            d.req(a, [11], prompt_logprobs=False),
            d.req(b, [12], prompt_logprobs=False),
            d.req(c, random_ids(30, 4), prompt_logprobs=False),
            d.req(e, random_ids(50, 5), prompt_logprobs=False),
        ],
        True,
    )
    assert all(r.next_id >= 0 for r in res)
    # too many tokens for any shape, and prompt logprobs: eager in both
    f, g = Seq(slot=4), Seq(slot=5)
    step([d.req(f, random_ids(300, 6), prompt_logprobs=False)], False)
    step([d.req(g, random_ids(40, 7), prompt_logprobs=True)], False)
    # then decoding every request through the decode graphs still agrees
    step([d.req(s, [13], prompt_logprobs=False) for s in (a, b, c, e, f, g)], False)
