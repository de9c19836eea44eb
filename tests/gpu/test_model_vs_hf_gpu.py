"""Our bf16 CUDA path (fused kernels + FlashInfer + CUDA graphs) against Hugging Face transformers.

A small random Llama (GQA, llama3 RoPE scaling, head_dim 64) and a Qwen2 (q/k/v biases) are saved
with `save_pretrained` and loaded by our loader. The reference is HF in float32 on the GPU; HF in
bf16 shows how far plain bf16 arithmetic lands from it, and ours must land about as close.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("flashinfer")
transformers = pytest.importorskip("transformers")

from gpu_support import GPU_TINY, check_against_hf, hf_and_runner, random_ids  # noqa: E402
from model_support import Driver, Seq, hf_logits  # noqa: E402

VOCAB = GPU_TINY["vocab_size"]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}
VARIANTS = {"llama": dict(rope_parameters=LLAMA3_ROPE), "qwen2": dict(rope_theta=1e6)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    runner_args = dict(max_total_tokens=4096, cuda_graph_max_bs=4)
    return hf_and_runner(request.param, folder, runner_args, head_dim=64, **VARIANTS[request.param])


def test_prefill_chunks_prefix_and_graph_decode(setup):
    hf32, hf16, runner = setup
    d = Driver([runner])
    prompt = random_ids(100, 0, VOCAB)
    a = Seq(slot=0)
    [(res, (logits,))] = d.step([d.req(a, prompt)])
    check_against_hf(logits, hf32, hf16, prompt, slice(None))

    b = Seq(slot=1)  # chunked
    for lo, hi in [(0, 40), (40, 100)]:
        [(_, (logits,))] = d.step([d.req(b, prompt[lo:hi], sample=hi == 100)])
        check_against_hf(logits, hf32, hf16, prompt[:hi], slice(lo, hi))

    c = Seq(slot=2)  # cached prefix (page size 1: any length)
    d.share_prefix(c, a, 77)
    tail = random_ids(9, 1, VOCAB)
    [(_, (logits,))] = d.step([d.req(c, tail)])
    check_against_hf(logits, hf32, hf16, prompt[:77] + tail, slice(77, None))

    # greedy decode of a and c together: a CUDA graph of size 2
    seqs = {0: prompt + [int(hf_logits(hf32, prompt)[-1].argmax())], 2: prompt[:77] + tail}
    seqs[2].append(int(hf_logits(hf32, seqs[2])[-1].argmax()))
    for _ in range(5):
        outs = d.step([d.req(a, seqs[0][-1:]), d.req(c, seqs[2][-1:])])
        [(_, logits)] = outs
        for ids, got in zip(seqs.values(), logits):
            check_against_hf(got, hf32, hf16, ids, slice(-1, None))
            ids.append(int(hf_logits(hf32, ids)[-1].argmax()))  # feed the reference's token
