"""CPU intra-op threads per step (ModelRunner._cpu_threads_for, --cpu-small-step-threads): the
layers of a batch-1/2 decode step and of a lone request's chunk of at most SMALL_CHUNK_TOKENS run
on one thread, anything larger (a prefill of two requests, batch-3 decode, a lone request's
longer chunk) on all of the worker's threads, and the LM head always on all of them; 0 keeps all
threads for everything. The tokens are the same either way."""

from __future__ import annotations

import pytest
import torch

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.worker.model_runner import SMALL_CHUNK_TOKENS, SMALL_STEP_TOKENS, ModelRunner

GREEDY = m.SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # cpu_threads(): the worker's threads
    yield
    torch.set_num_threads(before)


def decode_threads(small: int) -> tuple[list[tuple[int, int]], list[int]]:
    """((threads of the layers, of the LM head) per step, tokens of slot 0): a prefill of two
    requests, three batch-2 decode steps, two batch-1 decode steps, a 2-token prefill, a batch-3
    decode step, then lone prefills of 9 and of SMALL_CHUNK_TOKENS + 1 tokens."""
    args = ServerArgs(
        model="tiny-llama", load_format="dummy", model_config="tiny-llama", device="cpu",
        max_total_tokens=512, max_running_requests=6, cpu_small_step_threads=small,
    )  # fmt: skip
    r = ModelRunner(args)
    seen, tokens = [], []
    layers, head = r.model.forward, r.model.compute_logits
    during: dict[str, int] = {}

    def record(name, fn):
        def wrapped(*a, **k):
            during[name] = torch.get_num_threads()
            return fn(*a, **k)

        return wrapped

    r.model.forward = record("layers", layers)
    r.model.compute_logits = record("head", head)
    prompts = {0: [5, 6, 7, 8], 1: [9, 10, 11], 2: [12, 13], 3: list(range(20, 29)),
               4: list(range(30, 31 + SMALL_CHUNK_TOKENS))}  # fmt: skip
    last = {}
    step = 0

    def run(reqs):
        nonlocal step
        out = r.forward(m.ForwardBatch(step=step, reqs=reqs))
        step += 1
        seen.append((during["layers"], during["head"]))
        for req, res in zip(reqs, out.results):
            last[req.slot] = (res.next_id, req.start_pos + len(m.unpack_ids(req.input_ids)))
            if req.slot == 0:
                tokens.append(res.next_id)

    def opening(slot):
        ids = prompts[slot]
        pages = list(range(1 + 40 * slot, 41 + 40 * slot))
        return m.ForwardReq(slot=slot, input_ids=m.pack_ids(ids), start_pos=0,
                            new_pages=m.pack_ids(pages), new_slot=True, sampling=GREEDY)  # fmt: skip

    def dec(slot):
        tok, pos = last[slot]
        return m.ForwardReq(slot=slot, input_ids=m.pack_ids([tok]), start_pos=pos)

    run([opening(0), opening(1)])
    for _ in range(3):
        run([dec(0), dec(1)])
    for _ in range(2):
        run([dec(0)])
    run([opening(2)])
    run([dec(0), dec(1), dec(2)])
    run([opening(3)])
    run([opening(4)])
    return seen, tokens


def test_small_steps_run_on_one_thread_and_give_the_same_tokens():
    assert SMALL_STEP_TOKENS == 2 and SMALL_CHUNK_TOKENS == 32
    seen, tokens = decode_threads(small=1)
    # layers: prefill of two (7 tokens) 2; batch-2 and batch-1 decode 1; a 2-token prefill 1;
    # batch 3: 2; a lone 9-token prefill 1, a lone 33-token one 2
    assert [layers for layers, _ in seen] == [2, 1, 1, 1, 1, 1, 1, 2, 1, 2]
    assert [head for _, head in seen] == [2] * 10
    seen_all, tokens_all = decode_threads(small=0)
    assert seen_all == [(2, 2)] * 10
    assert tokens == tokens_all


def test_small_steps_use_every_thread_by_default():
    """With the kernels on every thread (OpenMP) and a short spin between parallel regions, two
    threads beat one on every step size measured (docs/decisions.md, "The CPU kernels on every
    thread"): 1 is the opt-in for a machine where other jobs hold cores."""
    assert ServerArgs().cpu_small_step_threads == 0


def test_flag_rejects_negative_threads():
    with pytest.raises(ValueError, match="cpu-small-step-threads"):
        ServerArgs(cpu_small_step_threads=-1).validate()
