"""Quantized serving on the GPU: each FP8 kernel against its torch reference at Llama-3.1-8B
shapes, FP8 KV attention (Triton decode, FlashInfer prefill and decode) against a bf16 pool, a
cached prefix read from an FP8 pool against the same prompt computed whole, and FP8 weights
through the runner (GEMV at batch 1, `torch._scaled_mm` beyond, CUDA graphs) against bf16."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")
pytest.importorskip("flashinfer")

from gpu_support import copy_weights, cuda_runner, greedy_agrees, random_ids, rel_err  # noqa: E402
from model_support import Driver, Seq  # noqa: E402

from radix_runtime.worker.kernels import decode_attention, fp8_quant, gemv, kv_store  # noqa: E402
from radix_runtime.worker.quant import Fp8Linear  # noqa: E402

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
MARGIN = 0.25  # logit gap above which FP8 rounding cannot flip the argmax


def _fp8_rows(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device=DEV) * 0.02
    s = w.abs().amax(1) / 448.0
    return (w / s[:, None]).to(FP8), s


@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv_fp8(page_size):
    n, hkv, d = 300, 8, 128
    pages = 4096 // page_size
    k = torch.randn(n, hkv, d, device=DEV, dtype=torch.bfloat16) * 3
    v = torch.randn(n, hkv, d, device=DEV, dtype=torch.bfloat16) * 300  # some beyond 448 * 0.5
    loc = torch.randperm(pages * page_size, device=DEV)[:n]
    shape = (pages, page_size, hkv, d)
    kc, vc = torch.zeros(shape, device=DEV, dtype=FP8), torch.zeros(shape, device=DEV, dtype=FP8)
    kr, vr = kc.clone(), vc.clone()
    kv_store.store_kv(kc, vc, loc, k, v, 0.5, 0.5)
    kv_store.store_kv_torch(kr, vr, loc, k, v, 0.5, 0.5)
    same = (kc.view(torch.uint8) == kr.view(torch.uint8)).float().mean().item()
    assert same > 0.999, same  # the same rounding (ties may differ)
    assert not vc.float().isnan().any()  # clamped, not NaN
    assert torch.equal(vc.float().abs().amax(), torch.tensor(448.0, device=DEV))


@pytest.mark.parametrize("lens", [[1], [1000], [5, 4100, 77, 300]])
def test_decode_attention_fp8(lens):
    """The Triton split-KV decode reading an FP8 pool (scales folded in) against the reference."""
    page_size, h, hkv, d = 16, 32, 8, 128
    pages = [-(-n // page_size) for n in lens]
    total = sum(pages) + 3
    k_cache = torch.randn(total, page_size, hkv, d, device=DEV).to(FP8)
    v_cache = torch.randn(total, page_size, hkv, d, device=DEV).to(FP8)
    ids = (torch.randperm(total - 1, device=DEV)[: sum(pages)] + 1).int()
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32,
                          device=DEV)  # fmt: skip
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages)], dtype=torch.int32,
                        device=DEV)  # fmt: skip
    q = torch.randn(len(lens), h, d, device=DEV, dtype=torch.bfloat16)
    args = (q, k_cache, v_cache, indptr, ids, last, d**-0.5)
    want = decode_attention.decode_attention_torch(*args, k_scale=0.7, v_scale=1.3)
    got = decode_attention.decode_attention(*args, k_scale=0.7, v_scale=1.3)
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336)])
def test_fp8_gemv(n, k):
    w, s = _fp8_rows(n, k)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    ref = x.double() @ (w.double() * s.double()[:, None]).T
    assert rel_err(gemv.gemv(x, w, w_scale=s), ref) < 5e-3
    res = torch.randn(1, n, device=DEV, dtype=torch.bfloat16)
    want = res.double() + ref
    assert rel_err(gemv.gemv(x, w, w_scale=s, add_to=res.clone()), want) < 5e-3


@pytest.mark.parametrize("shape", [(1, 4096), (300, 14336), (7, 100)])
def test_quantize_rows_fp8(shape):
    x = torch.randn(*shape, device=DEV, dtype=torch.bfloat16) * 5
    q, s = fp8_quant.quantize_rows_fp8(x)
    ref_s = x.float().abs().amax(-1, keepdim=True) / 448.0
    assert torch.allclose(s, ref_s, rtol=1e-6)
    ref_q = (x.float() / ref_s).to(FP8)
    same = (q.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean().item()
    assert same > 0.999, same  # division rounding may move a tie now and then


@pytest.mark.parametrize("m", [2, 64, 8192])
def test_fp8_linear_scaled_mm(m):
    """Fp8Linear on CUDA (per-token FP8 activations, torch._scaled_mm) against the same
    quantization done in float64 here."""
    n, k = 6144, 4096
    dense = torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(dense)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    xs = x.float().abs().amax(-1, keepdim=True) / 448.0
    xq = (x.float() / xs).to(FP8).double() * xs.double()
    ref = xq @ (layer.weight.double() * layer.weight_scale.double()[:, None]).T
    got = layer(x)
    assert got.dtype == torch.bfloat16 and rel_err(got, ref) < 1e-2
    assert rel_err(got, x.double() @ dense.weight.double().T) < 8e-2  # and near the bf16 layer


def _pair(**fp8_flags):
    base = cuda_runner(page_size=16)
    other = cuda_runner(page_size=16, **fp8_flags)
    if "quantization" not in fp8_flags:
        copy_weights(other, base)
    return base, other


def _agree(outs, tol: float, what: str) -> None:
    (_, ref), (_, got) = outs
    for i, (r, g) in enumerate(zip(ref, got)):
        if r is None:
            continue
        assert rel_err(g, r) < tol, f"{what}[{i}]: rel err {rel_err(g, r):.3f}"
        assert greedy_agrees(g, r, MARGIN), f"{what}[{i}]: argmax differs on a decisive row"


def test_fp8_kv_attention_against_bf16_kv():
    """FlashInfer prefill (FA2, FP8 KV), FlashInfer decode (12 requests) and the Triton decode
    (2 requests) over an FP8 pool, against the same model over a bf16 pool."""
    bf16, fp8 = _pair(kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_pool.is_fp8 and fp8.attn.name == "flashinfer"
    d = Driver([bf16, fp8])
    seqs = [Seq(slot=i) for i in range(12)]
    outs = d.step([d.req(s, random_ids(40 + 13 * i, i)) for i, s in enumerate(seqs)])
    _agree(outs, 5e-2, "prefill")
    tokens = [r.next_id for r in outs[0][0]]
    for step in range(3):
        outs = d.step([d.req(s, [t]) for s, t in zip(seqs, tokens)])
        _agree(outs, 5e-2, f"decode x12 {step}")
        tokens = [r.next_id for r in outs[0][0]]
    outs = d.step([d.req(s, [t]) for s, t in zip(seqs[:2], tokens[:2])])
    _agree(outs, 5e-2, "decode x2 (Triton)")


def test_fp8_kv_cached_prefix_equals_whole_prompt():
    """Cache on == off with FP8 KV: a prompt whose first 512 tokens are read from another
    request's FP8 pages gives the logits (and greedy choices, where decisive) of the same prompt
    computed whole, and so do the decode steps after it."""
    runner = cuda_runner(page_size=16, kv_cache_dtype="fp8_e4m3")
    d = Driver([runner])
    prompt = random_ids(600, 3)
    a = Seq(slot=0)
    d.step([d.req(a, prompt[:512], sample=False)])
    hit, cold = Seq(slot=1), Seq(slot=2)
    d.share_prefix(hit, a, 512)
    got = d.step([d.req(hit, prompt[512:])])[0][1][0]
    want = d.step([d.req(cold, prompt)])[0][1][0][512:]
    assert rel_err(got, want) < 2e-2 and greedy_agrees(got, want, MARGIN)
    tok = int(want[-1].argmax())
    for step in range(4):  # both continue from the same token
        (results, (g, w)) = d.step([d.req(hit, [tok]), d.req(cold, [tok])])[0]
        assert rel_err(g, w) < 2e-2 and greedy_agrees(g, w, MARGIN), step
        tok = results[1].next_id


def test_fp8_weights_through_the_runner():
    """--quantization fp8: prefill (scaled_mm), batch-1 decode (FP8 GEMV in the fused row path,
    CUDA graph) and batch-4 decode (scaled_mm, graph) against the bf16 model it was made from."""
    bf16 = cuda_runner(page_size=16)
    fp8 = cuda_runner(page_size=16, quantization="fp8")
    # the same seed gives both the same dummy bf16 weights; fp8's were then quantized
    assert fp8.quantization == "fp8" and fp8.model.model.layers[0].mlp.down_proj.weight.dtype == FP8
    d = Driver([bf16, fp8])
    seqs = [Seq(slot=i) for i in range(4)]
    outs = d.step([d.req(s, random_ids(50 + i, 10 + i)) for i, s in enumerate(seqs)])
    _agree(outs, 0.1, "prefill")
    tokens = [r.next_id for r in outs[0][0]]
    for step in range(3):
        outs = d.step([d.req(s, [t]) for s, t in zip(seqs, tokens)])
        _agree(outs, 0.1, f"decode x4 {step}")
        tokens = [r.next_id for r in outs[0][0]]
        outs = d.step([d.req(seqs[0], [tokens[0]])])
        _agree(outs, 0.1, f"decode x1 {step}")
        tokens[0] = outs[0][0][0].next_id
