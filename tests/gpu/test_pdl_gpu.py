"""Programmatic dependent launch (KernelConfig.pdl) and the GEMV's GELU prologue on the GPU.

A one-token layer's kernel chain (norm-GEMV, RoPE, KV store, split-KV attention, residual GEMVs,
bf16 / FP8 / int4 weights) gives the same bits launched dependently as launched plainly, eagerly
and replayed from a CUDA graph (each kernel waits for the writes of the one before it); Gemma's
gelu(tanh)-gated down projection as a GEMV prologue matches its torch reference at the 12B shape.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")
pytest.importorskip("flashinfer")

from gpu_support import rel_err  # noqa: E402

from radix_runtime.worker.kernels import KernelConfig, gemv  # noqa: E402
from radix_runtime.worker.kernels._triton import pdl_supported  # noqa: E402
from radix_runtime.worker.kernels.decode_attention import decode_attention  # noqa: E402
from radix_runtime.worker.kernels.int4_gemv import (  # noqa: E402
    int4_gemv,
    int4_gemv_scales,
    interleave_quads,
    pack_int4_rows,
)
from radix_runtime.worker.kernels.kv_store import store_kv  # noqa: E402
from radix_runtime.worker.kernels.ops import FusedOps  # noqa: E402
from radix_runtime.worker.kernels.rope import rotary_qk  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
needs_pdl = pytest.mark.skipif(not pdl_supported(), reason="needs a GPU and Triton with PDL")


def _layer(h: int, hkv: int, d: int, inter: int, weights: str):
    """One layer's weights (bf16, FP8 with row scales, or packed int4) and a 1,024-token KV."""
    hid = h * d
    shapes = {"qkv": ((h + 2 * hkv) * d, hid), "o": (hid, hid), "gu": (2 * inter, hid),
              "down": (hid, inter)}  # fmt: skip
    layer = {}
    for name, (n, k) in shapes.items():
        if weights == "int4":
            q = torch.randint(0, 16, (n, k), device=DEV)
            s = torch.rand(n, k // 128, device=DEV) * 0.002 + 1e-4
            z = torch.randint(0, 16, (n, k // 128), device=DEV, dtype=torch.uint8)
            layer[name] = (interleave_quads(pack_int4_rows(q)), int4_gemv_scales(s, z))
        else:
            w = torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5
            if weights == "fp8":
                scale = w.float().abs().amax(1) / 448.0
                layer[name] = ((w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale)
            else:
                layer[name] = (w, None)
    ctx = 1024
    layer["cache"] = (torch.randn(ctx + 8, 1, hkv, d, device=DEV, dtype=BF16),
                      torch.randn(ctx + 8, 1, hkv, d, device=DEV, dtype=BF16))  # fmt: skip
    layer["norm"] = torch.randn(hid, device=DEV, dtype=BF16)
    return layer


def _project(x, layer, name, weights, pdl, **fused):
    w, extra = layer[name]
    if weights == "int4":
        return int4_gemv(x, w, extra, 128, pdl=pdl, **fused)
    return gemv.gemv(x, w, w_scale=extra, pdl=pdl, **fused)


def _step_inputs(d: int):
    """The step's index arrays and RoPE rows (made outside any graph capture)."""
    ctx = 1024
    pos = torch.full((1,), ctx, device=DEV)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    emb = torch.cat([pos.float()[:, None] * inv] * 2, dim=-1)[:, None, :]
    return {
        "kv": (torch.tensor([0, ctx + 1], dtype=torch.int32, device=DEV),
               torch.arange(ctx + 1, dtype=torch.int32, device=DEV),
               torch.ones(1, dtype=torch.int32, device=DEV)),
        "loc": torch.tensor([ctx], dtype=torch.int64, device=DEV),
        "cos_sin": (emb.cos().to(BF16), emb.sin().to(BF16)),
    }  # fmt: skip


def _decode_layers(layers, residual, weights: str, pdl: bool, h: int, hkv: int, d: int, inp):
    """The one-token path's kernels over `layers`, the residual updated in place."""
    cos, sin = inp["cos_sin"]
    indptr, indices, last = inp["kv"]
    loc = inp["loc"]
    for layer in layers:
        qkv = _project(residual, layer, "qkv", weights, pdl, norm_weight=layer["norm"])
        q, k = rotary_qk(qkv, cos, sin, h, hkv, d, pdl=pdl)
        v = qkv[:, (h + hkv) * d :].view(1, hkv, d)
        store_kv(*layer["cache"], loc, k, v, pdl=pdl)
        out = decode_attention(q, *layer["cache"], indptr, indices, last, d**-0.5, pdl=pdl)
        _project(out.view(1, h * d), layer, "o", weights, pdl, add_to=residual)
        gu = _project(residual, layer, "gu", weights, pdl, norm_weight=layer["norm"])
        _project(gu, layer, "down", weights, pdl, silu=True, add_to=residual)
    return residual


@needs_pdl
@pytest.mark.parametrize("weights", ["bf16", "fp8", "int4"])
def test_dependent_launches_give_the_same_bits(weights):
    h, hkv, d, inter = 32, 8, 128, 14336  # Llama-3.1-8B's layer
    torch.manual_seed(0)
    layers = [_layer(h, hkv, d, inter, weights) for _ in range(3)]
    start = torch.randn(1, h * d, device=DEV, dtype=BF16)
    caches = [tuple(c.clone() for c in layer["cache"]) for layer in layers]
    inp = _step_inputs(d)

    def run(pdl: bool) -> torch.Tensor:
        for layer, cache in zip(layers, caches):  # the same KV every run
            layer["cache"][0].copy_(cache[0])
            layer["cache"][1].copy_(cache[1])
        return _decode_layers(layers, start.clone(), weights, pdl, h, hkv, d, inp)

    plain = run(False)
    assert torch.isfinite(plain.float()).all()
    assert torch.equal(run(True), plain)
    # replayed from a CUDA graph (how decode runs): the graph's edges keep the dependent launches
    residual = start.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _decode_layers(layers, residual.clone(), weights, True, h, hkv, d, inp)  # warm up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _decode_layers(layers, residual, weights, True, h, hkv, d, inp)
    for _ in range(3):
        for layer, cache in zip(layers, caches):
            layer["cache"][0].copy_(cache[0])
            layer["cache"][1].copy_(cache[1])
        residual.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(residual, plain)


def test_serving_config_launches_dependently_where_supported():
    assert KernelConfig().pdl
    assert FusedOps(KernelConfig()).pdl == pdl_supported()
    assert not FusedOps(KernelConfig(pdl=False)).pdl


@pytest.mark.parametrize("n,k", [(3840, 15360), (4096, 14336), (100, 3000)])
@pytest.mark.parametrize("add", [False, True])
def test_gemv_gelu_prologue(n, k, add):
    """Gemma's down projection of gelu_tanh(gate) * up (the 12B shape; K not a block multiple)."""
    torch.manual_seed(1)
    w = torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5
    x = torch.randn(1, 2 * k, device=DEV, dtype=BF16)
    res = torch.randn(1, n, device=DEV, dtype=BF16) if add else None
    want = gemv.gemv_torch(x, w, gelu=True, add_to=None if res is None else res.clone())
    for config in (None, (2, 2048, 2), (8, 256, 4)):
        got = gemv.gemv(x, w, gelu=True, add_to=None if res is None else res.clone(),
                        config=config)  # fmt: skip
        assert rel_err(got, want) < 1e-2, config


def test_gated_project_at_one_row_matches_the_activation_kernel_path():
    torch.manual_seed(2)
    layer = torch.nn.Linear(3000, 640, bias=False, device=DEV, dtype=BF16)
    x = torch.randn(1, 6000, device=DEV, dtype=BF16)
    ops = FusedOps(KernelConfig())
    for act, fn in (("gelu_tanh", ops.gelu_tanh_and_mul), ("silu", ops.silu_and_mul)):
        want = layer(fn(x)).float()
        assert rel_err(ops.gated_project(x, layer, act), want) < 1e-2
        assert rel_err(ops.gated_project(x.repeat(3, 1), layer, act), want.repeat(3, 1)) < 1e-2
