"""W4A16 on the GPU: the Triton int4 GEMV and GEMM against their torch reference at Llama-3.1-8B
shapes, and packed int4 weights through the runner (GEMV, GEMM or dequantize-per-call by rows,
CUDA graphs) against the same int4 rounding kept dequantized (KernelConfig(int4_gemv=False))."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")
pytest.importorskip("flashinfer")

from gpu_support import greedy_agrees, random_ids, rel_err  # noqa: E402
from model_support import Driver, Seq  # noqa: E402

from radix_runtime.config import ServerArgs  # noqa: E402
from radix_runtime.worker.kernels import KernelConfig  # noqa: E402
from radix_runtime.worker.kernels.int4_gemv import (  # noqa: E402
    int4_gemm,
    int4_gemv,
    int4_gemv_rows,
    int4_gemv_scales,
    int4_gemv_torch,
    interleave_quads,
    pack_int4_rows,
)
from radix_runtime.worker.model_runner import ModelRunner  # noqa: E402
from radix_runtime.worker.quant import Int4Linear  # noqa: E402

DEV = torch.device("cuda")
MARGIN = 0.25


def _packed(n: int, k: int, group: int):
    q = torch.randint(0, 16, (n, k), device=DEV)
    groups = -(-k // group)
    scales = torch.rand(n, groups, device=DEV) * 0.01 + 1e-3
    zeros = torch.randint(0, 16, (n, groups), device=DEV, dtype=torch.uint8)
    return interleave_quads(pack_int4_rows(q)), scales, zeros


SHAPES = [(6144, 4096, 128), (4096, 4096, 128), (28672, 4096, 128), (4096, 14336, 128),
          (100, 96, 64), (36, 1000, 8), (20, 200, 64)]  # fmt: skip
# the last three: a partial last group, K not a multiple of the word block, N of the quad block


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_int4_gemv_against_reference(n, k, group, m):
    qw, s, z = _packed(n, k, group)
    ac = int4_gemv_scales(s, z)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    want = int4_gemv_torch(x.float(), qw, s, z, group)
    for config in (None, (1, 32, 1), (2, 128, 4), (4, 128, 4), (8, 256, 8), (4, 64, 2)):
        got = int4_gemv(x, qw, ac, group, config)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert rel_err(got, want) < 5e-3, config


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("m", [2, 3, 4, 9, 16])
def test_int4_gemv_rows_against_reference(n, k, group, m):
    """The few-rows GEMV (2 or 4 input rows per program, row blocks beyond)."""
    qw, s, z = _packed(n, k, group)
    ac = int4_gemv_scales(s, z)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    want = int4_gemv_torch(x.float(), qw, s, z, group)
    for config in (None, (2, 4, 128, 4), (4, 2, 128, 4), (4, 1, 64, 2)):
        got = int4_gemv_rows(x, qw, ac, group, config)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert rel_err(got, want) < 5e-3, config


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_int4_gemv_fused_prologues(n, k, group):
    """The one-token layer's cases: rmsnorm(x) * w in, SiLU(gate) * up in and the residual add
    out, against the same ops in float32 around the reference."""
    qw, s, z = _packed(n, k, group)
    ac = int4_gemv_scales(s, z)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    nw = torch.rand(k, device=DEV, dtype=torch.bfloat16) + 0.5
    xf = x.float()
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.float()
    got = int4_gemv(x, qw, ac, group, norm_weight=nw, eps=1e-5)
    assert rel_err(got, int4_gemv_torch(xn, qw, s, z, group)) < 5e-3
    gu = torch.randn(1, 2 * k, device=DEV, dtype=torch.bfloat16)
    res = torch.randn(1, n, device=DEV, dtype=torch.bfloat16)
    gf = gu.float()
    want = res.float() + int4_gemv_torch(F.silu(gf[:, :k]) * gf[:, k:], qw, s, z, group).float()
    for config in (None, (4, 128, 4)):
        out = res.clone()
        got = int4_gemv(gu, qw, ac, group, config, silu=True, add_to=out)
        assert got is out and rel_err(out, want) < 5e-3, config


@pytest.mark.parametrize("n,k,group", [(6144, 4096, 128), (4096, 14336, 128), (100, 96, 64)])
@pytest.mark.parametrize("m", [5, 16, 33, 200, 300])
def test_int4_gemm_against_reference(n, k, group, m):
    """The GEMM's tiles are rounded to bf16 before the tensor-core product (as the dequantized
    path rounds W): within bf16 rounding of the float32 reference."""
    qw, s, z = _packed(n, k, group)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    want = int4_gemv_torch(x.float(), qw, s, z, group)
    for config in (None, (32, 64, 16, 4, 2), (128, 128, 16, 8, 3)):
        got = int4_gemm(x, qw, s, z, group, config)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert rel_err(got, want) < 1e-2, config


def _runner(**kernels) -> ModelRunner:
    args = ServerArgs(model="tiny-llama", load_format="dummy", device="cuda", page_size=16,
                      max_total_tokens=4096, max_running_requests=16, cuda_graph_max_bs=8,
                      quantization="int4")  # fmt: skip
    return ModelRunner(args, kernels=KernelConfig(**kernels))


def _agree(outs, tol: float, what: str) -> None:
    (_, ref), (_, got) = outs
    for i, (r, g) in enumerate(zip(ref, got)):
        if r is None:
            continue
        assert rel_err(g, r) < tol, f"{what}[{i}]: rel err {rel_err(g, r):.4f}"
        assert greedy_agrees(g, r, MARGIN), f"{what}[{i}]: argmax differs on a decisive row"


def test_packed_int4_through_the_runner():
    """--quantization int4 packed against the same rounding dequantized at load: a prefill of
    ~200 rows (the GEMM), one of 300 (dequantized per call), decode of 8 rows (GEMM), 4 (GEMV)
    and 1 (the one-token path: the int4 GEMV with the norm / SiLU prologues and residual adds),
    the decode steps as CUDA graphs."""
    plain = _runner(int4_gemv=False)
    packed = _runner()
    layer = packed.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, Int4Linear) and packed.quantization == "int4"
    assert not isinstance(plain.model.model.layers[0].mlp.down_proj, Int4Linear)
    assert packed.cuda_graphs is not None
    d = Driver([plain, packed])
    seqs = [Seq(slot=i) for i in range(8)]
    outs = d.step([d.req(s, random_ids(50 + i, 10 + i)) for i, s in enumerate(seqs[:4])])
    _agree(outs, 3e-2, "prefill (GEMM)")
    tokens = [r.next_id for r in outs[0][0]]
    outs = d.step([d.req(s, random_ids(75, 20 + i)) for i, s in enumerate(seqs[4:])])
    _agree(outs, 3e-2, "prefill (dequantized per call)")
    tokens += [r.next_id for r in outs[0][0]]
    outs = d.step([d.req(s, [t]) for s, t in zip(seqs, tokens)])
    _agree(outs, 3e-2, "decode x8 (GEMM)")
    tokens = [r.next_id for r in outs[0][0]]
    seqs, tokens = seqs[:4], tokens[:4]
    for step in range(3):
        outs = d.step([d.req(s, [t]) for s, t in zip(seqs, tokens)])
        _agree(outs, 3e-2, f"decode x4 {step}")
        tokens = [r.next_id for r in outs[0][0]]
        outs = d.step([d.req(seqs[0], [tokens[0]])])
        _agree(outs, 3e-2, f"decode x1 {step}")
        tokens[0] = outs[0][0][0].next_id
