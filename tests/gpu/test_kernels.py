"""The fused CUDA kernels (worker/kernels) against their torch references, on fresh random data."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")
pytest.importorskip("flashinfer")

from gpu_support import rel_err  # noqa: E402

from radix_runtime.worker.kernels import (  # noqa: E402
    KernelConfig,
    activation,
    decode_attention,
    gemv,
    kv_store,
    norms,
    rope,
)
from radix_runtime.worker.kernels.ops import FusedOps  # noqa: E402

DEV = torch.device("cuda")
OPS = FusedOps(KernelConfig())  # what serving runs


def _cos_sin(n: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 100_000, (n,), device=DEV)
    inv = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    freqs = pos.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("shape", [(32, 8, 128), (8, 2, 64), (4, 4, 64)])
def test_rotary_qk(n, shape):
    h, hkv, d = shape
    qkv = torch.randn(n, (h + 2 * hkv) * d, device=DEV, dtype=torch.bfloat16)
    cos, sin = _cos_sin(n, d, torch.bfloat16)
    q, k = rope.rotary_qk(qkv, cos, sin, h, hkv, d)
    # reference in float64 from the same bf16 inputs
    q_ref, k_ref = rope.rotary_qk_torch(qkv.double(), cos.double(), sin.double(), h, hkv, d)
    assert q.shape == (n, h, d) and k.shape == (n, hkv, d) and q.is_contiguous()
    assert rel_err(q, q_ref) < 5e-3 and rel_err(k, k_ref) < 5e-3


@pytest.mark.parametrize("n", [1, 64, 1000])
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv_matches_torch(n, page_size):
    hkv, d, pages = 8, 128, 4096 // page_size
    qkv = torch.randn(n, (32 + 2 * hkv) * d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(n, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = qkv[:, (32 + hkv) * d :].view(-1, hkv, d)  # strided, as the model passes it
    loc = torch.randperm(pages * page_size, device=DEV)[:n]
    shape = (pages, page_size, hkv, d)
    k_cache = torch.full(shape, float("nan"), device=DEV, dtype=torch.bfloat16)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_store.store_kv(k_cache, v_cache, loc, k, v)
    kv_store.store_kv_torch(k_ref, v_ref, loc, k, v)
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert k_cache.isnan().sum() == (pages * page_size - n) * hkv * d  # nothing else touched


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (100, 64), (37, 1000)])
def test_gemv_and_linear_dispatch(n, k):
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    ref = x.double() @ w.double().T
    y = OPS.linear(x, w, None)  # one input row: the Triton GEMV
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    assert rel_err(y, ref) < 5e-3
    xs = torch.randn(3, k, device=DEV, dtype=torch.bfloat16)  # more rows: cuBLAS
    assert rel_err(OPS.linear(xs, w, None), xs.double() @ w.double().T) < 5e-3


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (100, 64), (37, 1000)])
@pytest.mark.parametrize("mode", ["plain", "norm", "silu"])
@pytest.mark.parametrize("add", [False, True])
def test_fused_gemv(n, k, mode, add):
    """gemv.gemv's prologues (RMSNorm, SiLU-and-mul) and residual-add epilogue against the
    float32 reference, at the table's configuration and at an uneven-K one."""
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
    x = torch.randn(1, 2 * k if mode == "silu" else k, device=DEV, dtype=torch.bfloat16)
    kw = {"silu": True} if mode == "silu" else {}
    if mode == "norm":
        kw = {"norm_weight": torch.randn(k, device=DEV, dtype=torch.bfloat16), "eps": 1e-5}
    for config in (None, (4, 256, 4)):
        res = torch.randn(1, n, device=DEV, dtype=torch.bfloat16)
        if add:
            got = gemv.gemv(x, w, add_to=res.clone(), config=config, **kw).float() - res.float()
            want = gemv.gemv_torch(x, w, add_to=res.clone(), **kw).float() - res.float()
        else:
            got = gemv.gemv(x, w, config=config, **kw)
            want = gemv.gemv_torch(x, w, **kw)
        assert got.shape == (1, n)
        assert rel_err(got, want) < 2e-2  # the added products carry the residual's bf16 rounding
    with pytest.raises(ValueError):
        gemv.gemv(torch.randn(2, k, device=DEV, dtype=torch.bfloat16), w)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lens", [[1], [1024], [5, 300, 17, 1], [8191, 2, 64, 100, 3, 7, 900, 33]])
@pytest.mark.parametrize("heads", [(32, 8), (4, 4)])
def test_decode_attention(page_size, lens, heads):
    """The Triton split-KV decode against the float32 reference, on scattered pages, for every
    split count the batch size can pick and one forced split count (more splits than tokens)."""
    h, hkv, d = heads[0], heads[1], 128
    pages = [-(-n // page_size) for n in lens]
    total = sum(pages) + 3
    k_cache = torch.randn(total, page_size, hkv, d, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    ids = (torch.randperm(total - 1, device=DEV)[: sum(pages)] + 1).int()
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32,
                          device=DEV)  # fmt: skip
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages)], dtype=torch.int32,
                        device=DEV)  # fmt: skip
    q = torch.randn(len(lens), h, d, device=DEV, dtype=torch.bfloat16)
    want = decode_attention.decode_attention_torch(q, k_cache, v_cache, indptr, ids, last, d**-0.5)
    for splits in (None, 32):
        got = decode_attention.decode_attention(
            q, k_cache, v_cache, indptr, ids, last, d**-0.5, splits
        )
        assert got.shape == q.shape and got.dtype == q.dtype
        assert rel_err(got, want.double()) < 1e-2


def test_silu_and_mul_triton():
    for rows in (1, 64, 65):
        gu = torch.randn(rows, 2 * 14336, device=DEV, dtype=torch.bfloat16)
        g, u = gu.double().chunk(2, -1)
        want = torch.nn.functional.silu(g) * u
        assert rel_err(activation.silu_and_mul_triton(gu), want) < 5e-3
        assert rel_err(activation.silu_and_mul(gu), want) < 5e-3


def test_flashinfer_norm_and_activation():
    x = torch.randn(37, 4096, device=DEV, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(4096, device=DEV, dtype=torch.bfloat16)

    def ref_norm(t: torch.Tensor) -> torch.Tensor:
        t = t.double()
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()

    assert rel_err(norms.rmsnorm(x, w, 1e-5), ref_norm(x)) < 5e-3
    want_res = res.double() + x.double()
    out = norms.fused_add_rmsnorm(x.clone(), res, w, 1e-5)
    assert rel_err(res, want_res) < 5e-3
    assert rel_err(out, ref_norm(res)) < 5e-3
    gu = torch.randn(37, 2 * 1000, device=DEV, dtype=torch.bfloat16)
    g, u = gu.double().chunk(2, -1)
    assert rel_err(activation.silu_and_mul(gu), torch.nn.functional.silu(g) * u) < 5e-3


@pytest.mark.parametrize("offset", [0.0, 1.0])  # Qwen3's w, Gemma's (1 + w)
@pytest.mark.parametrize("shape", [(32, 8, 128), (16, 8, 256)])
def test_rotary_qk_with_head_norms(offset, shape):
    h, hkv, d = shape
    n = 37
    qkv = torch.randn(n, (h + 2 * hkv) * d, device=DEV, dtype=torch.bfloat16)
    cos, sin = _cos_sin(n, d, torch.bfloat16)
    qn = torch.randn(d, device=DEV, dtype=torch.bfloat16) * 0.2
    kn = torch.randn(d, device=DEV, dtype=torch.bfloat16) * 0.2
    q, k = rope.rotary_qk(qkv, cos, sin, h, hkv, d, qn, kn, 1e-6, offset)
    q_ref, k_ref = rope.rotary_qk_torch(
        qkv.double(), cos.double(), sin.double(), h, hkv, d, qn.double(), kn.double(), 1e-6,
        offset,
    )  # fmt: skip
    assert rel_err(q, q_ref) < 5e-3 and rel_err(k, k_ref) < 5e-3
    plain_q, _ = rope.rotary_qk(qkv, cos, sin, h, hkv, d)
    assert rel_err(plain_q, q_ref) > 1e-1  # the norm did something


@pytest.mark.parametrize("window", [1, 100, 1000, 5000])
def test_decode_attention_window(window):
    """Only each request's last `window` keys: against the windowed reference, and (for windows
    shorter than a sequence) visibly different from full attention."""
    page_size, h, hkv, d = 16, 32, 8, 128
    lens = [5, 300, 4100, 1]
    pages = [-(-n // page_size) for n in lens]
    total = sum(pages) + 3
    k_cache = torch.randn(total, page_size, hkv, d, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    ids = (torch.randperm(total - 1, device=DEV)[: sum(pages)] + 1).int()
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32,
                          device=DEV)  # fmt: skip
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages)], dtype=torch.int32,
                        device=DEV)  # fmt: skip
    q = torch.randn(len(lens), h, d, device=DEV, dtype=torch.bfloat16)
    want = decode_attention.decode_attention_torch(
        q, k_cache, v_cache, indptr, ids, last, d**-0.5, window=window
    )
    for splits in (None, 32):
        got = decode_attention.decode_attention(
            q, k_cache, v_cache, indptr, ids, last, d**-0.5, splits, window=window
        )
        assert rel_err(got, want.double()) < 1e-2
    full = decode_attention.decode_attention_torch(q, k_cache, v_cache, indptr, ids, last, d**-0.5)
    if window < 300:
        assert rel_err(full, want.double()) > 1e-1


def test_gemma_norms_and_gelu():
    x = torch.randn(37, 3840, device=DEV, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(3840, device=DEV, dtype=torch.bfloat16) * 0.1

    def ref_norm(t: torch.Tensor) -> torch.Tensor:
        t = t.double()
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())

    assert rel_err(norms.gemma_rmsnorm(x, w, 1e-6), ref_norm(x)) < 5e-3
    w_post = torch.randn_like(w) * 0.1
    want_res = res.double() + norms.gemma_rmsnorm_torch(x.double(), w_post.double(), 1e-6)
    out = norms.gemma_norm_add_norm(x, res, w_post, w, 1e-6)  # res += norm(x); norm(res)
    assert rel_err(res, want_res) < 5e-3 and rel_err(out, ref_norm(want_res)) < 5e-3
    gu = torch.randn(37, 2 * 1000, device=DEV, dtype=torch.bfloat16)
    g, u = gu.double().chunk(2, -1)
    want = torch.nn.functional.gelu(g, approximate="tanh") * u
    assert rel_err(activation.gelu_tanh_and_mul(gu), want) < 5e-3
