"""Packed int4 (W4A16) on the CPU: the torch reference of the int4 GEMV (kernels/int4_gemv.py)
against the dequantized path the runtime takes without the kernel.

The checkpoints are test_quant.py's (AWQ and GPTQ packed by plain torch code there); the packed
layers hold the same numbers as the dequantized ones, so every projection's output must agree to
float32 rounding. The Triton kernel itself is checked against the same reference on the GPU
(tests/gpu/test_int4_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from test_quant import _args, _tiny_llama, make_checkpoint

from radix_runtime.worker import quant
from radix_runtime.worker.kernels.int4_gemv import (
    dequantize_int4,
    int4_gemv,
    int4_gemv_rows,
    int4_gemv_scales,
    int4_gemv_torch,
    interleave_quads,
    pack_int4_rows,
    unpack_int4_rows,
)
from radix_runtime.worker.layers import Linear
from radix_runtime.worker.loader import load_model
from radix_runtime.worker.model_config import config_from_hf_dict
from radix_runtime.worker.models.registry import build_model

CPU = torch.device("cpu")


def test_pack_roundtrip_and_nibble_order():
    q = torch.randint(0, 16, (8, 24))
    rows = pack_int4_rows(q)
    assert rows.shape == (8, 3) and rows.dtype == torch.int32
    packed = interleave_quads(rows)
    assert packed.shape == (2, 3, 4)
    assert torch.equal(packed[1, 2], rows[4:8, 2])  # word 2 of rows 4..7 side by side
    assert torch.equal(unpack_int4_rows(packed), q)
    one = torch.zeros(1, 8, dtype=torch.int64)
    one[0, 7] = 15  # column 7 is the top nibble of word 0: the int32's sign bit
    assert pack_int4_rows(one).item() == -(1 << 28)
    with pytest.raises(ValueError, match="multiple of 4"):
        interleave_quads(pack_int4_rows(torch.zeros(6, 8, dtype=torch.int64)))


def test_gemv_scales_fold_the_zero_point():
    """The GEMV's per-group constants: a = 16 * scale, c = -scale * zero, four rows side by side;
    sum_k w x = a * (sum_k q x) / 16 + c * sum_k x."""
    scales = torch.rand(8, 3) + 0.1
    zeros = torch.randint(0, 16, (8, 3), dtype=torch.uint8)
    ac = int4_gemv_scales(scales, zeros)
    assert ac.shape == (2, 3, 2, 4)
    torch.testing.assert_close(ac[1, 2, 0], 16 * scales[4:8, 2])
    torch.testing.assert_close(ac[1, 2, 1], -scales[4:8, 2] * zeros[4:8, 2].float())


def test_the_gemv_kernel_in_the_triton_interpreter():
    """kernels/int4_gemv.py's GEMVs (the float trick for the nibbles, the quad layout, the fused
    norm / SiLU prologues and the residual epilogue, several rows at once) run by Triton's CPU
    interpreter against the reference, when Triton is installed (the GPU tests run them
    compiled)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 to run Triton kernels on the CPU")
    torch.manual_seed(0)
    n, k, group = 12, 192, 64
    q = torch.randint(0, 16, (n, k))
    qw = interleave_quads(pack_int4_rows(q))
    s, z = torch.rand(n, 3) * 0.01 + 1e-3, torch.randint(0, 16, (n, 3), dtype=torch.uint8)
    ac = int4_gemv_scales(s, z)
    x = torch.randn(2, k)
    torch.testing.assert_close(int4_gemv(x, qw, ac, group, (1, 16, 1)),
                               int4_gemv_torch(x, qw, s, z, group), rtol=1e-4, atol=1e-4)  # fmt: skip
    nw = torch.rand(k) + 0.5
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    got = int4_gemv(x, qw, ac, group, norm_weight=nw, eps=1e-6)
    torch.testing.assert_close(got, int4_gemv_torch(xn, qw, s, z, group), rtol=1e-4, atol=1e-4)
    for m, config in ((2, None), (3, None), (5, (4, 2, 16, 1)), (2, (2, 1, 32, 1))):
        xm = torch.randn(m, k)
        torch.testing.assert_close(int4_gemv_rows(xm, qw, ac, group, config),
                                   int4_gemv_torch(xm, qw, s, z, group), rtol=1e-4, atol=1e-4)  # fmt: skip
    x2, res = torch.randn(1, 2 * k), torch.randn(1, n)
    want = res + int4_gemv_torch(F.silu(x2[:, :k]) * x2[:, k:], qw, s, z, group)
    got = int4_gemv(x2, qw, ac, group, silu=True, add_to=res.clone())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_packed_checkpoint_equals_the_dequantized_one(fmt, tmp_path):
    """Every decoder projection of an AWQ / GPTQ checkpoint loaded packed (Int4Linear) against
    the same checkpoint dequantized at load: equal weights, and the reference GEMV equal to the
    dequantized layer's product."""
    folder, _ = make_checkpoint(fmt, tmp_path)
    args = _args(folder)
    packed = load_model(args, CPU, torch.float32, packed_int4=True).model
    plain = load_model(args, CPU, torch.float32).model
    layers = dict(plain.named_modules())
    checked = 0
    for name, layer in packed.named_modules():
        if not isinstance(layer, quant.Int4Linear):
            continue
        dense = layers[name]
        assert isinstance(dense, Linear)
        w = dequantize_int4(layer.qweight, layer.scales, layer.zeros, layer.group_size)
        assert torch.equal(w, dense.weight)
        x = torch.randn(3, dense.weight.shape[1])
        want = F.linear(x, dense.weight)
        got = int4_gemv_torch(x, layer.qweight, layer.scales, layer.zeros, layer.group_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
        checked += 1
    assert checked == 2 * 4  # 2 layers x (qkv, o, gate_up, down)
    assert packed.quantization == fmt and packed.packed_int4 and not plain.packed_int4


def test_rtn_packed_equals_rtn_dequantized():
    """--quantization int4 on CUDA packs what it rounds; the CPU keeps it dequantized: the same
    weights either way (groups of 128 columns, 64 where 128 does not divide)."""
    torch.manual_seed(0)
    for k in (256, 192):
        dense = Linear(k, 40, True, torch.float32)
        dense.weight.data.normal_(0, 0.1)
        dense.bias.data.normal_(0, 0.1)
        layer = quant.Int4Linear.from_linear(dense)
        assert layer.group_size == (128 if k == 256 else 64)
        want_w = quant.rtn_int4(dense.weight.data)
        got_w = dequantize_int4(layer.qweight, layer.scales, layer.zeros, layer.group_size)
        assert torch.equal(got_w, want_w)
        x = torch.randn(2, k)
        torch.testing.assert_close(layer(x), F.linear(x, want_w, dense.bias), rtol=1e-5, atol=1e-5)


def test_rtn_model_is_packed_when_asked():
    net = build_model(config_from_hf_dict(_tiny_llama().config.to_dict()), CPU, torch.float32)
    for p in net.parameters():
        p.data.normal_(0, 0.1)
    quant.quantize_model_int4_rtn(net, packed=True)
    kinds = {type(layer) for _, _, layer in _projections(net)}
    assert kinds == {quant.Int4Linear} and net.quantization == "int4" and net.packed_int4


def test_shapes_the_kernels_cannot_take_stay_dequantized():
    """A projection whose input width is not whole packed words of whole groups of 8 keeps the
    dequantized weight (the kernels would refuse it at run time)."""
    assert quant.int4_packable(8, 256, 128) and not quant.int4_packable(8, 36, 4)
    assert not quant.int4_packable(6, 256, 128)  # rows in quads
    cfg = _tiny_llama().config.to_dict()
    cfg.update(hidden_size=36, num_attention_heads=2, num_key_value_heads=1, head_dim=18)
    net = build_model(config_from_hf_dict(cfg), CPU, torch.float32)
    for p in net.parameters():
        p.data.normal_(0, 0.1)
    quant.quantize_model_int4_rtn(net, packed=True)
    kinds = {name: type(layer) for _, name, layer in _projections(net)}
    assert kinds["qkv_proj"] is not quant.Int4Linear  # K = 36
    assert kinds["down_proj"] is quant.Int4Linear  # K = 128
    assert net.packed_int4  # the fused path then takes no batch-1 GEMV-only route


def _projections(net):
    for parent in net.model.layers.modules():
        for name, child in parent.named_children():
            if name.endswith("_proj"):
                yield parent, name, child


def test_fused_path_picks_the_int4_kernel_by_rows(monkeypatch):
    """FusedOps.project on a packed layer: the GEMV up to int4_gemv_max_rows rows, the GEMM up to
    int4_gemm_max_rows, the layer's own (dequantizing) forward beyond, and always with
    int4_gemv off; the few-rows GEMV for 2..int4_rows_max_rows rows when that is set; the bias
    is added after a kernel."""
    from radix_runtime.worker.kernels import KernelConfig, int4_gemv
    from radix_runtime.worker.kernels.ops import FusedOps

    calls = []
    dense = Linear(128, 24, True, torch.float32)
    dense.weight.data.normal_(0, 0.1)
    dense.bias.data.normal_(0, 0.1)
    layer = quant.Int4Linear.from_linear(dense)

    def gemv(x, qweight, gemv_scales, group, config=None):
        assert gemv_scales is layer.gemv_scales
        calls.append(("gemv", x.shape[0]))
        return int4_gemv_torch(x, qweight, layer.scales, layer.zeros, group)

    def gemm(x, qweight, scales, zeros, group, config=None):
        calls.append(("gemm", x.shape[0]))
        return int4_gemv_torch(x, qweight, scales, zeros, group)

    def gemv_rows(x, qweight, gemv_scales, group, config=None):
        calls.append(("rows", x.shape[0]))
        return int4_gemv_torch(x, qweight, layer.scales, layer.zeros, group)

    monkeypatch.setattr(int4_gemv, "int4_gemv", gemv)
    monkeypatch.setattr(int4_gemv, "int4_gemm", gemm)
    monkeypatch.setattr(int4_gemv, "int4_gemv_rows", gemv_rows)
    ops = FusedOps(KernelConfig(int4_gemv_max_rows=2, int4_gemm_max_rows=16, int4_rows_max_rows=0))
    for rows in (1, 2, 3, 16, 17):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(ops.project(x, layer), layer(x), rtol=1e-5, atol=1e-5)
    assert calls == [("gemv", 1), ("gemv", 2), ("gemm", 3), ("gemm", 16)]
    FusedOps(KernelConfig(int4_gemv=False)).project(torch.randn(1, 128), layer)
    assert len(calls) == 4
    # the few-rows GEMV, when on, takes 2..int4_rows_max_rows rows before the thresholds above
    ops = FusedOps(KernelConfig(int4_rows_max_rows=8, int4_gemm_max_rows=16))
    for rows in (1, 2, 8, 9):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(ops.project(x, layer), layer(x), rtol=1e-5, atol=1e-5)
    assert calls[4:] == [("gemv", 1), ("rows", 2), ("rows", 8), ("gemm", 9)]
    # the default (measured on the H200): the few-rows GEMV for 2..16 rows, the GEMM beyond
    ops = FusedOps(KernelConfig())
    for rows in (1, 16, 17):
        ops.project(torch.randn(rows, 128), layer)
    assert calls[8:] == [("gemv", 1), ("rows", 16), ("gemm", 17)]


def test_int4_gemv_rows_refuses_an_input_of_the_wrong_width():
    q = torch.randint(0, 16, (8, 64))
    qweight = interleave_quads(pack_int4_rows(q))
    ac = int4_gemv_scales(torch.rand(8, 2), torch.zeros(8, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="input of 32 columns for a weight of 64"):
        int4_gemv_rows(torch.randn(2, 32), qweight, ac, 32)
