"""Constrained decoding on CUDA: xgrammar's bitmask applied to device logits under every sampler
setting, min_tokens, and a constrained slot decoding with the overlap schedule's launch-ahead
(its mask waits for the previous token through the step's event and pinned host copy)."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("xgrammar")
pytest.importorskip("flashinfer")

from gpu_support import cuda_runner  # noqa: E402
from grammar_steps import REGEX, check_constrained, check_min_tokens, is_prefix  # noqa: E402

from radix_runtime import messages as m  # noqa: E402

CUDA = torch.device("cuda")


def test_mask_holds_for_every_sampler_setting_cuda():
    check_constrained(CUDA)


def test_min_tokens_cuda():
    check_min_tokens(CUDA)


def _compile(runner, kind, text):
    runner.compile_grammar(kind, text)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for done in runner.finished_compiles():
            assert done.error is None, done.error
            return
        time.sleep(0.01)
    raise AssertionError("the grammar did not compile")


def _decode_steps(runner, ahead: bool, n: int = 12) -> list[int]:
    """n greedy tokens of one constrained slot, cut after the grammar's end."""
    sampling = m.SamplingParams(temperature=0.0, regex=REGEX, max_new_tokens=64)
    prompt = list(range(40, 60))
    pages = list(range(1, 1 + (len(prompt) + n) // 4 + 2))
    first = m.ForwardBatch(
        step=1,
        reqs=[
            m.ForwardReq(
                slot=0, input_ids=m.pack_ids(prompt), start_pos=0, new_pages=m.pack_ids(pages),
                new_slot=True, sampling=sampling,
            )
        ],
    )  # fmt: skip
    results: list[m.ForwardReqResult] = []
    if not ahead:
        results.append(runner.forward(first).results[0])
        for step in range(2, n + 1):
            req = m.ForwardReq(
                slot=0,
                input_ids=m.pack_ids([results[-1].next_id]),
                start_pos=len(prompt) + step - 2,
            )
            results.append(runner.forward(m.ForwardBatch(step=step, reqs=[req])).results[0])
    else:
        pending = runner.launch(first)
        for step in range(2, n + 1):
            req = m.ForwardReq(
                slot=0, input_ids=b"", start_pos=len(prompt) + step - 2, from_last_sample=True
            )
            following = runner.launch(m.ForwardBatch(step=step, reqs=[req]))
            results.append(runner.collect(pending).results[0])
            pending = following
        results.append(runner.collect(pending).results[0])
    runner.forward(m.ForwardBatch(step=0, reqs=[], released_slots=[0]))
    done = [r.grammar_done for r in results]
    return [r.next_id for r in results][: done.index(True) if True in done else n]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_constrained_launch_ahead_equals_synchronous(graphs):
    import os

    from radix_runtime.config import auto_grammar_fill_threads

    runner = cuda_runner(page_size=4, disable_cuda_graph=not graphs)
    # the default fill threads of a CUDA worker (8 on the H200's 16 cores) fill the masks here
    cores = len(os.sched_getaffinity(0))
    assert runner.sampler.fill_threads == auto_grammar_fill_threads("cuda", cores)
    _compile(runner, "regex", REGEX)
    sync = _decode_steps(runner, ahead=False)
    ahead = _decode_steps(runner, ahead=True)
    assert ahead == sync
    text = bytes(b for t in sync for b in runner.grammars.info.decoded_vocab[t]).decode()
    assert is_prefix(text), text


def test_masks_are_queued_without_waiting_for_the_device():
    """The grammar path never drains the stream: the mask goes up from pinned memory with a
    non-blocking copy, so while a long kernel still runs the host has already queued the mask
    and the sampling behind it (a blocking copy would return only after the kernel)."""
    from grammar_steps import EOS, grammar_cache

    from radix_runtime.messages import SamplingParams
    from radix_runtime.worker.sampler import Sampler

    tokenizer, cache = grammar_cache()
    cache.submit("regex", REGEX)
    for threads in (0, 2):
        sampler = Sampler(
            tokenizer.vocab_size, CUDA, seed=0, eos_token_ids=[EOS], grammars=cache,
            fill_threads=threads,
        )  # fmt: skip
        slots = [0, 1, 2]
        logits = torch.zeros(len(slots), tokenizer.vocab_size, device=CUDA)
        logits[:, tokenizer.encode("x", add_special_tokens=False)[0]] = 10.0  # never allowed

        def reset(sampler=sampler):
            sampler.reset_slot(0, SamplingParams(temperature=0.0, regex=REGEX))
            sampler.reset_slot(1, SamplingParams(temperature=0.0))
            sampler.reset_slot(2, SamplingParams(temperature=0.0, regex=REGEX, min_tokens=4))

        reset()
        sampler.sample_on_device(logits.clone(), slots, [False] * 3, [0] * 3)  # compiles kernels
        reset()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of device time
        ids = sampler.sample_on_device(logits, slots, [False] * 3, [0] * 3).next_ids
        assert not torch.cuda.current_stream().query(), "the host waited for the device"
        host = ids.cpu().tolist()
        text = [tokenizer.decode([t]) for t in host]
        assert is_prefix(text[0]) and is_prefix(text[2]), text
        assert text[1] == "x"  # the unconstrained row is not masked


def test_padded_vocabulary_cuda():
    from grammar_steps import check_padded_vocabulary

    check_padded_vocabulary(CUDA)
