"""Our paged Llama-family model against Hugging Face transformers, through the real ModelRunner path.

Small random checkpoints (Llama with GQA + llama3 RoPE scaling, Qwen2 with q/k/v biases, Llama with
tied embeddings) are saved with `save_pretrained`, loaded by our loader (load_format auto), and
driven with real ForwardBatch messages: full prefill, chunked prefill, a cached prefix shared by a
fresh slot, greedy decode, and a batch mixing a prefill with decodes. Every request asks for prompt
logprobs, so the runner computes logits on all its rows; `forward_with_logits` hands them back.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import transformers

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.worker.model_runner import ModelRunner

ATOL = 1e-4
# float32 everywhere; RADIX_RUNTIME_TEST_DEVICE=cuda runs our side of the same checks on a GPU
DEVICE = os.environ.get("RADIX_RUNTIME_TEST_DEVICE", "cpu")
VOCAB = 128
GREEDY = m.SamplingParams(temperature=0.0)


def _hf_config(variant: str) -> transformers.PretrainedConfig:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        eos_token_id=2,
        bos_token_id=1,
    )
    if variant == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=1e6)
    if variant == "tied":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    rope = {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 10000.0,
    }
    return transformers.LlamaConfig(**common, rope_parameters=rope)


def _make_hf_model(variant: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = _hf_config(variant)
    cls = transformers.Qwen2ForCausalLM if variant == "qwen2" else transformers.LlamaForCausalLM
    model = cls(config).float().eval()
    # HF initialises biases to 0 and norms to 1; perturb everything so each weight matters
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2", "tied"])
def checkpoint(request, tmp_path_factory):
    model = _make_hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder), model


def hf_logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


# ---------------------------------------------------------------------------------------------
# a test-side stand-in for the scheduler's page bookkeeping


@dataclass
class Seq:
    slot: int
    pages: list[int] = field(default_factory=list)
    sent_pages: int = 0  # pages the worker already has in this slot's row
    cached: int = 0  # tokens whose KV is in the pool
    opened: bool = False


class Driver:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.page_size = runner.page_size
        self.next_page = 1  # page 0 is reserved
        self.step_no = 0

    def alloc(self, n: int) -> list[int]:
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return pages

    def req(
        self, seq: Seq, ids: list[int], sample: bool = True, next_token: int = -1
    ) -> m.ForwardReq:
        need = math.ceil((seq.cached + len(ids)) / self.page_size)
        seq.pages += self.alloc(need - len(seq.pages))
        new_pages = seq.pages[seq.sent_pages :]
        r = m.ForwardReq(
            slot=seq.slot,
            input_ids=m.pack_ids(ids),
            start_pos=seq.cached,
            page_offset=seq.sent_pages,
            new_pages=m.pack_ids(new_pages),
            new_slot=not seq.opened,
            sample=sample,
            sampling=None if seq.opened else GREEDY,
            prompt_logprobs=True,
            next_token=next_token,
        )
        seq.sent_pages, seq.cached, seq.opened = len(seq.pages), seq.cached + len(ids), True
        return r

    def step(self, reqs: list[m.ForwardReq]):
        self.step_no += 1
        batch = m.decode(m.encode(m.ForwardBatch(step=self.step_no, reqs=reqs)))
        result, logits = self.runner.forward_with_logits(batch)
        assert result.step == self.step_no and len(result.results) == len(reqs)
        return result.results, logits


def _runner(folder: str, page_size: int) -> ModelRunner:
    args = ServerArgs(
        model=folder,
        page_size=page_size,
        max_total_tokens=2048,
        max_running_requests=8,
        device=DEVICE,
        dtype="float32",
    )
    return ModelRunner(args)


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    ours = ours.cpu()
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"max abs diff {diff}"


PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, VOCAB, size=45)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_chunks_prefix_and_decode(checkpoint, page_size):
    folder, hf = checkpoint
    runner = _runner(folder, page_size)
    assert runner.ready_info().eos_token_ids == [2]
    d = Driver(runner)
    ref = hf_logits(hf, PROMPT)

    # full prefill: logits of every row, prompt logprobs, and the greedy next token
    a = Seq(slot=0)
    (res,), (logits,) = d.step([d.req(a, PROMPT)])
    _close(logits, ref)
    want_lp = torch.log_softmax(ref, -1)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    got_lp = torch.from_numpy(m.unpack_floats(res.prompt_logprobs).copy())
    _close(got_lp, want_lp)
    assert res.next_id == int(ref[-1].argmax())

    # chunked prefill in 3 chunks: only the last one samples
    b = Seq(slot=1)
    bounds = [0, 13, 27, len(PROMPT)]
    for lo, hi in zip(bounds, bounds[1:]):
        last = hi == len(PROMPT)
        nxt = -1 if last else PROMPT[hi]
        (res,), (logits,) = d.step([d.req(b, PROMPT[lo:hi], sample=last, next_token=nxt)])
        _close(logits, ref[lo:hi])
        assert len(m.unpack_floats(res.prompt_logprobs)) == hi - lo - int(last)
        assert res.next_id == (int(ref[-1].argmax()) if last else -1)

    # a fresh slot reuses the first request's pages for a shared prefix, then diverges
    shared = (32 // page_size) * page_size if page_size > 1 else 29
    tail = [int(x) for x in np.random.default_rng(1).integers(3, VOCAB, size=10)]
    c = Seq(slot=2, pages=a.pages[: math.ceil(shared / page_size)], cached=shared)
    (res,), (logits,) = d.step([d.req(c, tail)])
    _close(logits, hf_logits(hf, PROMPT[:shared] + tail)[shared:])

    # greedy decode of request a, checked step by step against the full HF forward
    seq = PROMPT + [res_a := int(ref[-1].argmax())]
    for _ in range(6):
        (res,), (logits,) = d.step([d.req(a, [seq[-1]])])
        full = hf_logits(hf, seq)
        _close(logits, full[-1:])
        assert res.next_id == int(full[-1].argmax())
        seq.append(res.next_id)
    assert seq[len(PROMPT)] == res_a


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batch_one_prefill_two_decodes(checkpoint, page_size):
    folder, hf = checkpoint
    d = Driver(_runner(folder, page_size))
    prompts = [PROMPT[:20], PROMPT[5:36]]
    seqs = [Seq(slot=3), Seq(slot=5)]
    texts = []
    for s, p in zip(seqs, prompts):
        (res,), _ = d.step([d.req(s, p)])
        texts.append(p + [res.next_id])
    newcomer = Seq(slot=0)
    reqs = [
        d.req(seqs[0], texts[0][-1:]),
        d.req(newcomer, PROMPT[10:40]),
        d.req(seqs[1], texts[1][-1:]),
    ]
    results, logits = d.step(reqs)
    refs = [
        hf_logits(hf, texts[0])[-1:],
        hf_logits(hf, PROMPT[10:40]),
        hf_logits(hf, texts[1])[-1:],
    ]
    for res, got, want in zip(results, logits, refs):
        _close(got, want)
        assert res.next_id == int(want[-1].argmax())
        assert len(m.unpack_floats(res.prompt_logprobs)) == len(want) - 1


def test_only_needed_rows_get_logits(checkpoint):
    """Ordinary prefill computes the lm_head on the last row only; a non-sampling chunk on none."""
    folder, _ = checkpoint
    d = Driver(_runner(folder, 4))
    a, b = Seq(slot=0), Seq(slot=1)
    ra = d.req(a, PROMPT[:30])
    rb = d.req(b, PROMPT[:12], sample=False)
    plain = [
        m.ForwardReq(**{**_fields(ra), "prompt_logprobs": False}),
        m.ForwardReq(**{**_fields(rb), "prompt_logprobs": False}),
    ]
    results, logits = d.step(plain)
    assert logits[0].shape == (1, VOCAB) and logits[1] is None
    assert results[1].next_id == -1 and results[1].prompt_logprobs == b""


def _fields(r: m.ForwardReq) -> dict:
    return {f: getattr(r, f) for f in r.__struct_fields__}


def test_malformed_batches_are_rejected(checkpoint):
    """Scheduler bugs surface as clear errors, never as K/V written into the reserved page."""
    folder, _ = checkpoint
    runner = _runner(folder, 4)

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
