"""KernelConfig: the CUDA path's kernel choices live in one object per runner, not in module state.

The kernels themselves need CUDA (tests/gpu/test_kernels.py); here the dispatch that a config
drives is checked on the CPU with the Triton GEMV replaced by a recorder.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from radix_runtime.config import ServerArgs
from radix_runtime.worker.kernels import KernelConfig, fp8_gemv, gemv
from radix_runtime.worker.kernels.ops import FusedOps
from radix_runtime.worker.model_runner import ModelRunner


@pytest.fixture
def gemv_calls(monkeypatch):
    calls = []

    def fake_gemv(x, weight, **kw):
        calls.append(kw)
        return F.linear(x, weight)

    monkeypatch.setattr(gemv, "gemv", fake_gemv)
    return calls


def test_single_rows_take_the_gemv_with_the_configs_table(gemv_calls):
    table = {(5, 8, gemv.GEMV_PLAIN, False): (2, 8, 1)}
    ops = FusedOps(KernelConfig(gemv_configs=table))
    w = torch.randn(5, 8)
    x = torch.randn(1, 8)
    assert torch.allclose(ops.linear(x, w, None), x @ w.T)
    assert gemv_calls == [{"table": table, "pdl": False}]
    ops.linear(torch.randn(3, 8), w, None)  # more rows: F.linear
    ops.linear(x, w, torch.zeros(5))  # a bias: F.linear
    assert len(gemv_calls) == 1


def test_triton_gemv_off_sends_single_rows_to_cublas(gemv_calls):
    ops = FusedOps(replace(KernelConfig(), triton_gemv=False, row_fusion=False))
    ops.linear(torch.randn(1, 8), torch.randn(5, 8), None)
    assert gemv_calls == [] and ops.row_fusion is False


def test_fp8_projection_passes_its_scale(gemv_calls):
    layer = torch.nn.Linear(8, 5, bias=False)
    layer.weight_scale = torch.ones(5)
    FusedOps(KernelConfig()).project(torch.randn(1, 8), layer)
    assert gemv_calls[0]["w_scale"] is layer.weight_scale


def test_wide_fp8_projections_of_few_rows_take_the_tensor_core_gemv(gemv_calls, monkeypatch):
    """fp8_mma_max_rows / fp8_mma_min_n pick kernels/fp8_gemv.py's GEMV: the one-token path's
    fused projections and `project` at 1..16 rows of a wide FP8 layer; a narrow one keeps the
    W8A16 GEMV at one row and its own forward beyond; 0 rows: off."""
    mma = []

    def fake_mma(x, weight, w_scale, **kw):
        mma.append((x.shape[0], kw))
        return F.linear(x, weight)

    monkeypatch.setattr(fp8_gemv, "fp8_mma_gemv", fake_mma)
    wide, narrow = torch.nn.Linear(8, 40, bias=False), torch.nn.Linear(8, 5, bias=False)
    for layer in (wide, narrow):
        layer.weight_scale = torch.ones(layer.weight.shape[0])
    ops = FusedOps(KernelConfig(fp8_mma_min_n=40))
    res = torch.zeros(1, 40)
    ops.row_project(torch.randn(1, 8), wide, norm_weight=torch.ones(8), add_to=res)
    ops.project(torch.randn(16, 8), wide)
    assert mma == [(1, {"pdl": False, "norm_weight": mma[0][1]["norm_weight"], "eps": 1e-6,
                        "silu": False, "add_to": res}), (16, {"pdl": False})]  # fmt: skip
    ops.row_project(torch.randn(1, 8), narrow)  # narrow: the W8A16 GEMV
    assert len(mma) == 2 and gemv_calls[-1]["w_scale"] is narrow.weight_scale
    ops.project(torch.randn(17, 8), wide)  # 17 rows: the layer's own forward
    assert len(mma) == 2
    FusedOps(KernelConfig(fp8_mma_max_rows=0)).project(torch.randn(1, 8), wide)
    assert len(mma) == 2 and gemv_calls[-1]["w_scale"] is wide.weight_scale


def test_gemv_table_comes_from_the_sweep_named_by_the_environment(tmp_path, monkeypatch):
    sweep = {
        "cases": [{"rows": 7, "cols": 64, "prologue": 1, "add": True, "best_config": [8, 64, 2]}]
    }
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep))
    assert (7, 64, 1, True) not in KernelConfig().gemv_configs
    monkeypatch.setenv(gemv.GEMV_CONFIGS_ENV, str(path))
    table = KernelConfig().gemv_configs
    assert table[(7, 64, 1, True)] == (8, 64, 2)
    assert table[(6144, 4096, gemv.GEMV_PLAIN, False)] == gemv.GEMV_CONFIGS[(6144, 4096, 0, False)]


def test_runner_hands_its_config_to_the_attention_backend():
    kernels = KernelConfig(triton_decode_max_bs=0)
    args = ServerArgs(model="tiny-llama", load_format="dummy", device="cpu", max_total_tokens=256,
                      max_running_requests=2)  # fmt: skip
    runner = ModelRunner(args, kernels=kernels)
    assert runner.kernels is kernels and runner.attn.kernels is kernels


def test_dependent_launch_is_asked_for_but_only_used_where_supported():
    """Serving asks for PDL; a machine without a Hopper GPU and Triton's gdc_wait (this one, when
    it has no CUDA) launches plainly, and the launch keywords say so."""
    from radix_runtime.worker.kernels._triton import pdl_launch, pdl_supported

    assert KernelConfig().pdl
    assert KernelConfig().use_pdl() == pdl_supported()
    assert not KernelConfig(pdl=False).use_pdl()
    if not torch.cuda.is_available():
        assert not pdl_supported() and not FusedOps(KernelConfig()).pdl
    assert pdl_launch(False) == {"USE_PDL": False}
    assert pdl_launch(True) == {"USE_PDL": True, "launch_pdl": True}


def test_gemv_reference_of_the_gelu_prologue():
    torch.manual_seed(0)
    w, x = torch.randn(6, 8), torch.randn(1, 16)
    want = F.linear(F.gelu(x[:, :8], approximate="tanh") * x[:, 8:], w)
    assert torch.allclose(gemv.gemv_torch(x, w, gelu=True), want, atol=1e-6)
    with pytest.raises(ValueError, match="one prologue"):
        gemv.gemv(x, w, gelu=True, silu=True)


def test_disable_pdl_reaches_the_runners_kernel_config():
    """`--disable-pdl` is the server's way out of dependent launches: the runner's config (and so
    its attention backend's and fused ops') asks for plain launches; by default it asks for PDL."""
    common = dict(
        model_config="tiny-llama", load_format="dummy", device="cpu", max_total_tokens=256
    )
    assert ModelRunner(ServerArgs(**common)).kernels.pdl
    off = ModelRunner(ServerArgs(**common, disable_pdl=True))
    assert not off.kernels.pdl and not off.attn.kernels.pdl
