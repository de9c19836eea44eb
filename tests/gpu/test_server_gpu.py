"""The whole multi-process server on the GPU with dummy weights: /generate with token ids, the radix
cache across requests, and the same greedy tokens with CUDA graphs on and off."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("flashinfer")

from gpu_support import random_ids  # noqa: E402

FLAGS = ("--load-format", "dummy", "--model-config", "tiny-llama", "--max-total-tokens", "65536")
NEW_TOKENS = 24


def _generate(server, prompts: list[list[int]]) -> list[dict]:
    body = {
        "input_ids": prompts,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    with server.client(timeout=300) as c:
        r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _same_greedy(a: dict, b: dict) -> None:
    """Identical tokens, except that after a near-tie (top-2 logprob gap < 0.05 in either run)
    the runs may part: bf16 rounding differs between graph and eager attention kernels."""
    tops = a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]
    for t, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])):
        if x != y:
            gaps = [top[t][0][0] - top[t][1][0] for top in tops]
            assert min(gaps) < 0.05, f"token {t}: {x} vs {y} with logprob gaps {gaps}"
            return


def test_generate_cache_and_graphs(launch_server):
    graphs = launch_server(*FLAGS)
    shared = random_ids(300, 0)
    prompts = [shared + random_ids(20, i + 1) for i in range(6)] + [random_ids(5, 9)]

    first = _generate(graphs, prompts[:1])[0]
    assert len(first["output_ids"]) == NEW_TOKENS
    assert first["meta_info"]["finish_reason"]["type"] == "length"
    batch = _generate(graphs, prompts)  # decodes of 7 requests: a padded CUDA graph (8)
    assert [len(o["output_ids"]) for o in batch] == [NEW_TOKENS] * len(prompts)
    # the shared 300-token prefix is served from the radix cache
    assert all(o["meta_info"]["cached_tokens"] >= 300 for o in batch[:6]), [
        o["meta_info"]["cached_tokens"] for o in batch
    ]
    _same_greedy(first, batch[0])  # a batch of 1 and a batch of 7 agree

    eager = launch_server(*FLAGS, "--disable-cuda-graph")
    again = _generate(eager, prompts)
    for a, b in zip(batch, again):
        _same_greedy(a, b)
    assert "backend flashinfer, CUDA graphs on" in graphs.log()
    assert "backend flashinfer, CUDA graphs off" in eager.log()


def test_page_size_16_serves_the_same_tokens(launch_server):
    """--page-size 16 end to end (the GPU default candidate): page-aligned cache hits, and the
    greedy tokens of page size 1, CUDA graphs and the overlap schedule on."""
    shared = random_ids(300, 0)
    prompts = [shared + random_ids(20, i + 1) for i in range(6)] + [random_ids(5, 9)]
    pages = launch_server(*FLAGS, "--page-size", "16")
    _generate(pages, prompts[:1])  # the shared prefix into the tree
    paged = _generate(pages, prompts)
    # 300 shared tokens: 18 whole pages of 16 hit
    assert all(o["meta_info"]["cached_tokens"] == 288 for o in paged[1:6]), [
        o["meta_info"]["cached_tokens"] for o in paged
    ]
    tokens = launch_server(*FLAGS)
    _generate(tokens, prompts[:1])
    for a, b in zip(paged, _generate(tokens, prompts)):
        assert len(a["output_ids"]) == NEW_TOKENS
        _same_greedy(a, b)
    with pages.client() as c:
        assert c.get("/get_server_info").json()["cache"]["page_size"] == 16
