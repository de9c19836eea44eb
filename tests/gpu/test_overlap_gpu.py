"""launch / collect on the GPU (the overlap schedule's worker half): steps launched with
`from_last_sample` rows before the previous one is collected, through the decode and the
prefill/mixed CUDA graphs (which must read those ids from the device), equal synchronous
forwards. (tests/unit/test_overlap_runner.py checks the same logic on the CPU.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("flashinfer")

from gpu_support import cuda_runner  # noqa: E402

from radix_runtime import messages as m  # noqa: E402

GREEDY = m.SamplingParams(temperature=0.0)
PENALIZED = m.SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=1.5)
SEEDED = m.SamplingParams(temperature=0.9, top_k=20, seed=1234)


def req(slot, ids, start, pages=(), **kw):
    return m.ForwardReq(
        slot=slot, input_ids=m.pack_ids(ids), start_pos=start, new_pages=m.pack_ids(list(pages)), **kw
    )  # fmt: skip


def decode(slot, start, tokens, **kw):
    if tokens is None:
        return m.ForwardReq(slot=slot, input_ids=b"", start_pos=start, from_last_sample=True, **kw)
    return req(slot, [tokens[slot]], start, **kw)


def steps(tokens1=None, tokens2=None):
    first = m.ForwardBatch(
        step=1,
        reqs=[
            req(
                0,
                [5, 6, 7, 8, 9],
                0,
                [1, 2],
                new_slot=True,
                sampling=GREEDY,
                return_logprob=True,
                top_logprobs_num=3,
            ),  # fmt: skip
            req(1, [9, 10, 9, 10], 0, [3, 4], new_slot=True, sampling=PENALIZED),
            req(2, [11, 12, 13], 0, [5, 8], new_slot=True, sampling=SEEDED, return_logprob=True),
            req(3, [20, 21, 22, 23], 0, [6, 7], new_slot=True, sampling=GREEDY, sample=False),
        ],
    )
    # mixed: three decodes and a last chunk (an extend-graph replay)
    second = m.ForwardBatch(
        step=2,
        reqs=[
            decode(0, 5, tokens1, return_logprob=True, top_logprobs_num=3),
            decode(1, 4, tokens1),
            decode(2, 3, tokens1, return_logprob=True),
            req(3, [24, 25], 4),
        ],
    )
    # decode only (a decode-graph replay)
    third = m.ForwardBatch(step=3, reqs=[decode(s, p, tokens2) for s, p in enumerate([6, 5, 4, 6])])
    return first, second, third


def tokens_of(result):
    return {i: r.next_id for i, r in enumerate(result.results) if r.next_id >= 0}


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_launch_ahead_equals_synchronous_forwards(graphs):
    runner = cuda_runner(page_size=4, disable_cuda_graph=not graphs)
    release = m.ForwardBatch(step=0, reqs=[], released_slots=list(range(8)))
    first, _, _ = steps()
    r1 = runner.forward(first)
    _, second, _ = steps(tokens_of(r1))
    r2 = runner.forward(second)
    _, _, third = steps(tokens_of(r1), tokens_of(r2))
    r3 = runner.forward(third)
    runner.forward(release)
    pending = [runner.launch(b) for b in steps()]
    got = [runner.collect(p) for p in pending]
    runner.forward(release)
    for g, r in zip(got, (r1, r2, r3)):
        assert [x.next_id for x in g.results] == [x.next_id for x in r.results]
        for a, b in zip(g.results, r.results):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert a.top_ids == b.top_ids


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_launch_never_waits_for_the_device(graphs):
    """launch() must queue a step without a host-device sync (a blocking copy, an .item(), a
    pageable upload...), or the overlap schedule silently runs one step at a time again:
    CUDA's sync debug mode turns any such sync inside launch into an error."""
    runner = cuda_runner(page_size=4, disable_cuda_graph=not graphs)
    release = m.ForwardBatch(step=0, reqs=[], released_slots=list(range(8)))
    for watch in (False, True):  # the first round warms up (Triton compiles, allocations)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if watch else "default")
        try:
            pending = [runner.launch(b) for b in steps()]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for p in pending:
            runner.collect(p)
        runner.forward(release)
