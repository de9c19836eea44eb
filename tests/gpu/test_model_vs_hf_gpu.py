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

from gpu_support import Driver, Seq, greedy_agrees, random_ids, rel_err  # noqa: E402

from radix_runtime.config import ServerArgs  # noqa: E402
from radix_runtime.worker.model_runner import ModelRunner  # noqa: E402

VOCAB = 512


def _hf_model(variant: str):
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        eos_token_id=2,
        bos_token_id=1,
    )
    if variant == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rope_theta=1e6))
    else:
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, rope_parameters=rope)
        )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.05)
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    model = _hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    hf32 = model.float().cuda()
    hf16 = _hf_model(request.param).to(device="cuda", dtype=torch.bfloat16)
    hf16.load_state_dict(model.state_dict())  # same weights, rounded to bf16
    runner = ModelRunner(
        ServerArgs(model=str(folder), device="cuda", max_total_tokens=4096, cuda_graph_max_bs=4)
    )
    assert runner.dtype == torch.bfloat16 and runner.attn.name == "flashinfer"
    assert runner.cuda_graphs is not None
    return hf32, hf16, runner


def _hf(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda")).logits[0].float().cpu()


def _check(ours: torch.Tensor, hf32, hf16, ids: list[int], rows: slice) -> None:
    ref, base = _hf(hf32, ids)[rows], _hf(hf16, ids)[rows]
    err, err_hf16 = rel_err(ours, ref), rel_err(base, ref)
    assert err < 2 * err_hf16 + 5e-3, f"ours {err:.2e}, HF bf16 {err_hf16:.2e}"
    assert greedy_agrees(ours, ref, 0.1)


def test_prefill_chunks_prefix_and_graph_decode(setup):
    hf32, hf16, runner = setup
    d = Driver([runner])
    prompt = random_ids(100, 0, VOCAB)
    a = Seq(slot=0)
    [(res, (logits,))] = d.step([d.req(a, prompt)])
    _check(logits, hf32, hf16, prompt, slice(None))

    b = Seq(slot=1)  # chunked
    for lo, hi in [(0, 40), (40, 100)]:
        [(_, (logits,))] = d.step([d.req(b, prompt[lo:hi], sample=hi == 100)])
        _check(logits, hf32, hf16, prompt[:hi], slice(lo, hi))

    c = Seq(slot=2)  # cached prefix (page size 1: any length)
    d.share_prefix(c, a, 77)
    tail = random_ids(9, 1, VOCAB)
    [(_, (logits,))] = d.step([d.req(c, tail)])
    _check(logits, hf32, hf16, prompt[:77] + tail, slice(77, None))

    # greedy decode of a and c together: a CUDA graph of size 2
    seqs = {0: prompt + [int(_hf(hf32, prompt)[-1].argmax())], 2: prompt[:77] + tail}
    seqs[2].append(int(_hf(hf32, seqs[2])[-1].argmax()))
    for _ in range(5):
        outs = d.step([d.req(a, seqs[0][-1:]), d.req(c, seqs[2][-1:])])
        [(_, logits)] = outs
        for ids, got in zip(seqs.values(), logits):
            _check(got, hf32, hf16, ids, slice(-1, None))
            ids.append(int(_hf(hf32, ids)[-1].argmax()))  # feed the reference's token
