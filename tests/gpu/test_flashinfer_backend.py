"""The FlashInfer backend against the torch backend and a float32 reference, through ModelRunner.

Three runners get the same random tiny-llama weights (rounded to bf16 once, so the float32
reference computes the *same* model without bf16 activations) and identical ForwardBatch
messages: full prefill, chunked prefill, a fresh request on a cached prefix of another's pages,
a batch mixing decodes with a new prefill, and decode-only batches. Every request asks for
prompt logprobs, so logits come back for every row.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("flashinfer")

from gpu_support import copy_weights, cuda_runner, greedy_agrees, random_ids, rel_err  # noqa: E402
from model_support import Driver, Seq  # noqa: E402

# bf16 logits of a 4-layer model vs exact arithmetic: ~3e-3 relative; a real bug is >> 1e-1
MAX_REL_ERR = 2e-2
MARGIN = 0.05  # logit gap above which bf16 rounding cannot flip the argmax


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def runners(request):
    ps = request.param
    torch16 = cuda_runner(page_size=ps, attention_backend="torch")
    fi = cuda_runner(page_size=ps, disable_cuda_graph=True)  # auto: flashinfer on CUDA
    ref32 = cuda_runner(page_size=ps, dtype="float32")  # auto: torch (flashinfer has no fp32)
    assert fi.attn.name == "flashinfer" and torch16.attn.name == "torch"
    assert ref32.attn.name == "torch" and fi.dtype == torch.bfloat16
    copy_weights(fi, torch16)
    copy_weights(ref32, torch16)
    return ref32, torch16, fi


def _check(outs, what: str) -> None:
    (ref_res, ref), (t_res, t16), (f_res, fi) = outs
    for i, (r, t, f) in enumerate(zip(ref, t16, fi)):
        if r is None:
            assert t is None and f is None
            continue
        err_f, err_t = rel_err(f, r), rel_err(t, r)
        assert err_f < MAX_REL_ERR, f"{what}[{i}]: flashinfer rel err {err_f:.2e}"
        assert err_f < 2 * err_t + 2e-3, f"{what}[{i}]: flashinfer {err_f:.2e} vs torch {err_t:.2e}"
        assert rel_err(f, t) < MAX_REL_ERR
        assert greedy_agrees(f, r, MARGIN), f"{what}[{i}]: argmax differs on a decisive row"
    for a, b in zip(ref_res, f_res):
        assert (a.next_id >= 0) == (b.next_id >= 0)


def test_prefill_prefix_mixed_and_decode(runners):
    d = Driver(list(runners))
    prompt_a, prompt_b = random_ids(45, 0), random_ids(45, 1)

    a = Seq(slot=0)
    _check(d.step([d.req(a, prompt_a)]), "prefill")

    b = Seq(slot=1)  # chunked prefill: 3 chunks, only the last samples
    for lo, hi in [(0, 13), (13, 27), (27, 45)]:
        _check(d.step([d.req(b, prompt_b[lo:hi], sample=hi == 45)]), f"chunk {lo}:{hi}")

    c = Seq(slot=2)  # a prefix-cache hit: A's first 32 tokens, then its own 10
    d.share_prefix(c, a, 32)
    outs = d.step([d.req(c, random_ids(10, 2))])
    _check(outs, "cached prefix")
    # the cached-prefix request sees the same logits as recomputing the whole prompt would
    fresh = Seq(slot=3)
    recomputed = d.step([d.req(fresh, prompt_a[:32] + random_ids(10, 2))])
    assert rel_err(outs[2][1][0], recomputed[2][1][0][32:]) < MAX_REL_ERR

    # decodes of a, b, c next to a brand-new prefill in one batch
    e = Seq(slot=4)
    outs = d.step([d.req(a, [7]), d.req(e, random_ids(30, 3)), d.req(b, [8]), d.req(c, [9])])
    _check(outs, "mixed")

    # decode-only batches (FlashInfer's decode kernels), fed the reference's greedy tokens
    seqs = [a, b, c, e, fresh]
    tokens = [res.next_id for res in outs[0][0]] + [recomputed[0][0][0].next_id]
    tokens = [tokens[0], tokens[2], tokens[3], tokens[1], tokens[4]]
    for step in range(6):
        outs = d.step([d.req(s, [t]) for s, t in zip(seqs, tokens)])
        _check(outs, f"decode {step}")
        tokens = [res.next_id for res in outs[0][0]]


def test_long_prefix_across_many_pages(runners):
    """A 700-token history (44 pages of 16) with a 5-token continuation, then decode."""
    d = Driver(list(runners))
    d.next_page = 200  # clear of the other test's pages
    history = random_ids(700, 5)
    a = Seq(slot=6)
    for lo in range(0, 700, 256):  # chunked at 256
        hi = min(lo + 256, 700)
        _check(d.step([d.req(a, history[lo:hi], sample=hi == 700)]), f"chunk {lo}")
    b = Seq(slot=7)
    d.share_prefix(b, a, 688)
    outs = d.step([d.req(b, history[688:700] + random_ids(5, 6))])
    _check(outs, "long cached prefix")
    token = outs[0][0][0].next_id
    for step in range(3):
        outs = d.step([d.req(b, [token])])
        _check(outs, f"long decode {step}")
        token = outs[0][0][0].next_id
