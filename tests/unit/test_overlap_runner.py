"""ModelRunner.launch / collect (the worker's half of the overlap schedule), on CPU with the
torch backend: the same code path as on CUDA, where launch only queues device work.

A step launched with `from_last_sample` rows before the previous step is collected must give
what two synchronous forwards give, with the unknown tokens taken from the device."""

from __future__ import annotations

import pytest
import torch
from overlap_steps import GREEDY, RELEASE, first_step, req, second_step, third_step, tokens_of

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner():
    args = ServerArgs(
        model="tiny-llama",
        load_format="dummy",
        model_config="tiny-llama",
        device="cpu",
        max_total_tokens=1024,
        max_running_requests=8,
        page_size=4,
    )
    return ModelRunner(args)


def release_all(runner):
    runner.forward(RELEASE)


def strip_time(result: m.ForwardResult) -> m.ForwardResult:
    return m.ForwardResult(step=result.step, results=result.results)


def test_launch_ahead_equals_synchronous_forwards(runner):
    release_all(runner)
    r1 = runner.forward(first_step())
    r2 = runner.forward(second_step(tokens_of(r1)))
    r3 = runner.forward(third_step(tokens_of(r2)))
    release_all(runner)
    # two and three steps in flight before anything is collected
    p1 = runner.launch(first_step())
    p2 = runner.launch(second_step(None))
    p3 = runner.launch(third_step(None))
    got = [runner.collect(p) for p in (p1, p2, p3)]
    release_all(runner)
    assert [strip_time(g) for g in got] == [strip_time(r) for r in (r1, r2, r3)]
    assert got[1].results[0].top_ids and got[1].results[0].logprob < 0
    assert all(g.forward_s > 0 for g in got)


def test_forward_is_collect_of_launch(runner):
    release_all(runner)
    a = runner.forward(first_step())
    release_all(runner)
    pending = runner.launch(first_step())
    assert pending.ready()  # on the CPU launch does the work
    b = runner.collect(pending)
    release_all(runner)
    assert strip_time(a) == strip_time(b)


def test_forward_with_logits_still_returns_rows(runner):
    release_all(runner)
    result, logits = runner.forward_with_logits(first_step())
    release_all(runner)
    assert [x is None for x in logits] == [False, False, False, True]
    assert int(torch.argmax(logits[0][-1])) == result.results[0].next_id


def test_from_last_sample_is_validated(runner):
    release_all(runner)
    with pytest.raises(ValueError, match="from_last_sample with input_ids"):
        runner.launch(
            m.ForwardBatch(
                step=1,
                reqs=[req(0, [5], 0, [1], new_slot=True, sampling=GREEDY, from_last_sample=True)],
            )
        )
    release_all(runner)
    # a slot that only computed a chunk has sampled nothing
    runner.forward(
        m.ForwardBatch(
            step=1, reqs=[req(0, [5, 6], 0, [1], new_slot=True, sampling=GREEDY, sample=False)]
        )
    )
    with pytest.raises(ValueError, match="sampled nothing"):
        runner.launch(
            m.ForwardBatch(
                step=2,
                reqs=[m.ForwardReq(slot=0, input_ids=b"", start_pos=2, from_last_sample=True)],
            )
        )
    # a fresh slot (new_slot) forgets what the slot sampled before
    runner.forward(m.ForwardBatch(step=3, reqs=[req(0, [7], 2, sample=True)]))
    with pytest.raises(ValueError, match="sampled nothing"):
        runner.launch(
            m.ForwardBatch(
                step=4,
                reqs=[
                    m.ForwardReq(
                        slot=0,
                        input_ids=b"",
                        start_pos=0,
                        new_slot=True,
                        sampling=GREEDY,
                        new_pages=m.pack_ids([1]),
                        from_last_sample=True,
                    )  # fmt: skip
                ],
            )
        )
    release_all(runner)


def test_the_pages_of_the_steps_in_flight_are_known_until_collected(runner):
    """The host tier's copies wait only for the running steps that touch their pages
    (HostKVPool.copy's `busy`): the runner knows each launched step's pages until it is
    collected."""
    release_all(runner)
    assert len(runner.pages_in_flight().read) == 0
    p1 = runner.launch(first_step())
    busy = runner.pages_in_flight()
    # page size 4: slot 0's 5 tokens fill pages 1, 2; slots 1, 2, 3 the first of theirs (3,
    # 5, 6); their second pages (4, 8, 7) are not used yet
    assert set(busy.read.tolist()) == set(busy.written.tolist()) == {1, 2, 3, 5, 6}
    p2 = runner.launch(second_step(None))  # decodes write one slot each; slot 3 its last chunk
    busy = runner.pages_in_flight()  # both steps
    assert set(busy.written.tolist()) == {1, 2, 3, 4, 5, 6, 7}
    runner.collect(p1)
    busy = runner.pages_in_flight()
    # step 2 alone: slot 0 writes position 5 (page 2), slot 1 position 4 (page 4), slot 2
    # position 3 (page 5), slot 3 positions 4, 5 (page 7); it reads every page of those rows
    assert sorted(set(busy.written.tolist())) == [2, 4, 5, 7]
    assert set(busy.read.tolist()) == {1, 2, 3, 4, 5, 6, 7}
    runner.collect(p2)
    assert len(runner.pages_in_flight().read) == len(runner.pages_in_flight().written) == 0
    release_all(runner)
