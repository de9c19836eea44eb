"""Three worker steps for the overlap-schedule tests (tests/unit/test_overlap_runner.py on the
CPU, tests/gpu/test_overlap_gpu.py on the GPU): new requests with greedy, penalized and seeded
sampling, logprobs and a chunk that samples nothing; then a mixed step; then a decode-only one.
With `tokens` None the decodes feed the token their slot just sampled (`from_last_sample`), else
the given ones (what a synchronous run knows)."""

from __future__ import annotations

from radix_runtime import messages as m

GREEDY = m.SamplingParams(temperature=0.0)
PENALIZED = m.SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=1.5)
SEEDED = m.SamplingParams(temperature=0.9, top_k=20, seed=1234)
RELEASE = m.ForwardBatch(step=0, reqs=[], released_slots=list(range(8)))


def req(slot, ids, start, pages=(), offset=0, **kw):
    return m.ForwardReq(
        slot=slot,
        input_ids=m.pack_ids(ids),
        start_pos=start,
        page_offset=offset,
        new_pages=m.pack_ids(list(pages)),
        **kw,
    )


def decode(slot, start, tokens: dict[int, int] | None, **kw):
    if tokens is None:
        return m.ForwardReq(slot=slot, input_ids=b"", start_pos=start, from_last_sample=True, **kw)
    return req(slot, [tokens[slot]], start, **kw)


def first_step():
    """Four new requests; slot 3 is a chunk that samples nothing."""
    return m.ForwardBatch(
        step=1,
        reqs=[
            req(0, [5, 6, 7, 8, 9], 0, [1, 2], new_slot=True, sampling=GREEDY, return_logprob=True,
                top_logprobs_num=3),
            req(1, [9, 10, 9, 10], 0, [3, 4], new_slot=True, sampling=PENALIZED),
            req(2, [11, 12, 13], 0, [5, 8], new_slot=True, sampling=SEEDED, return_logprob=True),
            req(3, [20, 21, 22, 23], 0, [6, 7], new_slot=True, sampling=GREEDY, sample=False),
        ],
    )  # fmt: skip


def second_step(tokens: dict[int, int] | None):
    """Slots 0-2 decode (an extend-graph replay on the GPU), slot 3 gets its last chunk."""
    return m.ForwardBatch(
        step=2,
        reqs=[
            decode(0, 5, tokens, return_logprob=True, top_logprobs_num=3),
            decode(1, 4, tokens),
            decode(2, 3, tokens, return_logprob=True),
            req(3, [24, 25], 4),
        ],
    )


def third_step(tokens: dict[int, int] | None):
    """Every slot decodes again, slot 3 its first output (a decode-graph replay on the GPU)."""
    return m.ForwardBatch(step=3, reqs=[decode(s, p, tokens) for s, p in enumerate([6, 5, 4, 6])])


def tokens_of(result: m.ForwardResult) -> dict[int, int]:
    return {i: r.next_id for i, r in enumerate(result.results) if r.next_id >= 0}
