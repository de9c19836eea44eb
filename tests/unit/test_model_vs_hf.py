"""Our paged Llama-family model against Hugging Face transformers, through the real ModelRunner path.

Small random checkpoints (Llama with GQA + llama3 RoPE scaling, Qwen2 with q/k/v biases, Llama with
tied embeddings) are saved with `save_pretrained`, loaded by our loader (load_format auto), and
driven with real ForwardBatch messages: full prefill, chunked prefill, a cached prefix shared by a
fresh slot, greedy decode, and a batch mixing a prefill with decodes. Every request asks for prompt
logprobs, so the runner computes logits on all its rows; `forward_with_logits` hands them back.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from model_support import (
    PROMPT,
    VOCAB,
    Driver,
    Seq,
    assert_logits_close,
    float32_runner,
    hf_logits,
    save_hf,
    tiny_hf_model,
)

from radix_runtime import messages as m

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}
VARIANTS = {
    "llama": ("llama", dict(rope_parameters=LLAMA3_ROPE)),  # GQA + llama3 RoPE scaling
    "qwen2": ("qwen2", dict(rope_theta=1e6)),  # q/k/v biases
    "tied": ("llama", dict(tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    arch, config = VARIANTS[request.param]
    model = tiny_hf_model(arch, bias_std=0.1, **config)
    return save_hf(model, tmp_path_factory.mktemp(request.param)), model


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_chunks_prefix_and_decode(checkpoint, page_size):
    folder, hf = checkpoint
    runner = float32_runner(folder, page_size)
    assert runner.ready_info().eos_token_ids == [2]
    d = Driver(runner)
    ref = hf_logits(hf, PROMPT)

    # full prefill: logits of every row, prompt logprobs, and the greedy next token
    a = Seq(slot=0)
    (res,), (logits,) = d.forward([d.req(a, PROMPT)])
    assert_logits_close(logits, ref)
    want_lp = torch.log_softmax(ref, -1)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    got_lp = torch.from_numpy(m.unpack_floats(res.prompt_logprobs).copy())
    assert_logits_close(got_lp, want_lp)
    assert res.next_id == int(ref[-1].argmax())

    # chunked prefill in 3 chunks: only the last one samples
    b = Seq(slot=1)
    bounds = [0, 13, 27, len(PROMPT)]
    for lo, hi in zip(bounds, bounds[1:]):
        last = hi == len(PROMPT)
        nxt = -1 if last else PROMPT[hi]
        (res,), (logits,) = d.forward([d.req(b, PROMPT[lo:hi], sample=last, next_token=nxt)])
        assert_logits_close(logits, ref[lo:hi])
        assert len(m.unpack_floats(res.prompt_logprobs)) == hi - lo - int(last)
        assert res.next_id == (int(ref[-1].argmax()) if last else -1)

    # a fresh slot reuses the first request's pages for a shared prefix, then diverges
    shared = (32 // page_size) * page_size if page_size > 1 else 29
    tail = [int(x) for x in np.random.default_rng(1).integers(3, VOCAB, size=10)]
    c = Seq(slot=2, pages=a.pages[: math.ceil(shared / page_size)], cached=shared)
    (res,), (logits,) = d.forward([d.req(c, tail)])
    assert_logits_close(logits, hf_logits(hf, PROMPT[:shared] + tail)[shared:])

    # greedy decode of request a, checked step by step against the full HF forward
    seq = PROMPT + [res_a := int(ref[-1].argmax())]
    for _ in range(6):
        (res,), (logits,) = d.forward([d.req(a, [seq[-1]])])
        full = hf_logits(hf, seq)
        assert_logits_close(logits, full[-1:])
        assert res.next_id == int(full[-1].argmax())
        seq.append(res.next_id)
    assert seq[len(PROMPT)] == res_a


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batch_one_prefill_two_decodes(checkpoint, page_size):
    folder, hf = checkpoint
    d = Driver(float32_runner(folder, page_size))
    prompts = [PROMPT[:20], PROMPT[5:36]]
    seqs = [Seq(slot=3), Seq(slot=5)]
    texts = []
    for s, p in zip(seqs, prompts):
        (res,), _ = d.forward([d.req(s, p)])
        texts.append(p + [res.next_id])
    newcomer = Seq(slot=0)
    reqs = [
        d.req(seqs[0], texts[0][-1:]),
        d.req(newcomer, PROMPT[10:40]),
        d.req(seqs[1], texts[1][-1:]),
    ]
    results, logits = d.forward(reqs)
    refs = [
        hf_logits(hf, texts[0])[-1:],
        hf_logits(hf, PROMPT[10:40]),
        hf_logits(hf, texts[1])[-1:],
    ]
    for res, got, want in zip(results, logits, refs):
        assert_logits_close(got, want)
        assert res.next_id == int(want[-1].argmax())
        assert len(m.unpack_floats(res.prompt_logprobs)) == len(want) - 1


def test_only_needed_rows_get_logits(checkpoint):
    """Ordinary prefill computes the lm_head on the last row only; a non-sampling chunk on none."""
    folder, _ = checkpoint
    d = Driver(float32_runner(folder, 4))
    a, b = Seq(slot=0), Seq(slot=1)
    ra = d.req(a, PROMPT[:30])
    rb = d.req(b, PROMPT[:12], sample=False)
    plain = [
        m.ForwardReq(**{**_fields(ra), "prompt_logprobs": False}),
        m.ForwardReq(**{**_fields(rb), "prompt_logprobs": False}),
    ]
    results, logits = d.forward(plain)
    assert logits[0].shape == (1, VOCAB) and logits[1] is None
    assert results[1].next_id == -1 and results[1].prompt_logprobs == b""


def _fields(r: m.ForwardReq) -> dict:
    return {f: getattr(r, f) for f in r.__struct_fields__}


def test_malformed_batches_are_rejected(checkpoint):
    """Scheduler bugs surface as clear errors, never as K/V written into the reserved page."""
    folder, _ = checkpoint
    runner = float32_runner(folder, 4)

    def step(**fields) -> None:
        req = {"slot": 0, "input_ids": m.pack_ids([5, 6, 7]), "start_pos": 0, "new_slot": True}
        runner.forward(m.ForwardBatch(step=1, reqs=[m.ForwardReq(**{**req, **fields})]))

    with pytest.raises(ValueError, match="no page"):
        step()  # no pages sent at all
    with pytest.raises(ValueError, match="page ids"):
        step(new_pages=m.pack_ids([0]))
    with pytest.raises(ValueError, match="never opened"):
        step(new_slot=False, slot=3, new_pages=m.pack_ids([1]))
    step(new_pages=m.pack_ids([1]))
    runner.forward(m.ForwardBatch(step=2, reqs=[], released_slots=[0]))
    with pytest.raises(ValueError, match="never opened"):
        step(new_slot=False, input_ids=m.pack_ids([8]), start_pos=3)
