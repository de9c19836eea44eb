"""kernels/fp8_gemv.py's W8A8 tensor-core GEMV against its torch reference at the Llama-3.1-8B
one-token layer's shapes (every prologue, the residual add, 1 to 16 input rows, both tile
orientations), and an FP8 model through the runner with it on against the same model with it
off (the W8A16 GEMV at one row, per-token quantization + torch._scaled_mm beyond)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")
pytest.importorskip("flashinfer")

from gpu_support import greedy_agrees, random_ids, rel_err  # noqa: E402
from model_support import Driver, Seq  # noqa: E402

from radix_runtime.config import ServerArgs  # noqa: E402
from radix_runtime.worker.kernels import KernelConfig  # noqa: E402
from radix_runtime.worker.kernels.fp8_gemv import (  # noqa: E402
    FP8_MMA_CONFIGS,
    fp8_mma_gemv,
    fp8_mma_gemv_torch,
)
from radix_runtime.worker.model_runner import ModelRunner  # noqa: E402

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
MARGIN = 0.25
# the kernel's default tile, a wide non-swapped one and the weight-first (swapped) orientation
CONFIGS = [None, (64, 512, 4, 3, 0), (64, 256, 4, 4, 1)]


def _fp8_rows(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device=DEV) * 0.02
    s = w.abs().amax(1) / 448.0
    return (w / s[:, None]).to(FP8), s


def _args(k: int, m: int, prologue: str) -> tuple[torch.Tensor, dict]:
    x = torch.randn(m, 2 * k if prologue in ("silu", "gelu") else k, device=DEV,
                    dtype=torch.bfloat16)  # fmt: skip
    if prologue == "norm":
        return x, {"norm_weight": torch.rand(k, device=DEV, dtype=torch.bfloat16) + 0.5}
    return x, ({prologue: True} if prologue in ("silu", "gelu") else {})


@pytest.mark.parametrize(
    "n,k,prologue,add",
    [(6144, 4096, "norm", False), (4096, 4096, "plain", True), (28672, 4096, "norm", False),
     (4096, 14336, "silu", True), (4096, 14336, "gelu", True), (1000, 200, "plain", False)],
)  # fmt: skip
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fp8_mma_gemv_against_reference(n, k, prologue, add, m):
    """Within bf16 rounding of the float32 reference (which rounds the input through e4m3 per
    row the same way; a SiLU / GELU computed in another order may flip an input's rounding)."""
    w, s = _fp8_rows(n, k)
    x, kw = _args(k, m, prologue)
    res = torch.randn(m, n, device=DEV, dtype=torch.bfloat16) if add else None
    want = fp8_mma_gemv_torch(x, w, s, add_to=None if res is None else res.clone(), **kw)
    for config in CONFIGS:
        got = fp8_mma_gemv(x, w, s, add_to=None if res is None else res.clone(), config=config,
                           **kw)  # fmt: skip
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert rel_err(got, want) < 1e-2, (config, rel_err(got, want))
    # and W8A8 against the float64 product of the unquantized input (the input's FP8 rounding)
    if prologue == "plain" and not add:
        exact = x.double() @ (w.double() * s.double()[:, None]).T
        assert rel_err(fp8_mma_gemv(x, w, s), exact) < 5e-2


def test_fp8_mma_gemv_tables_and_checks():
    for (n, k, _, _), config in FP8_MMA_CONFIGS.items():
        assert len(config) == 5 and n > 0 and k > 0
    w, s = _fp8_rows(64, 128)
    with pytest.raises(ValueError, match="input rows"):
        fp8_mma_gemv(torch.randn(17, 128, device=DEV, dtype=torch.bfloat16), w, s)
    with pytest.raises(ValueError, match="one prologue"):
        fp8_mma_gemv(torch.randn(1, 256, device=DEV, dtype=torch.bfloat16), w, s, silu=True,
                     gelu=True)  # fmt: skip


def _runner(head: bool = False, **kernels) -> ModelRunner:
    args = ServerArgs(model="tiny-llama", load_format="dummy", device="cuda", page_size=16,
                      max_total_tokens=4096, max_running_requests=16, cuda_graph_max_bs=8,
                      quantization="fp8", quantize_lm_head=head)  # fmt: skip
    return ModelRunner(args, kernels=KernelConfig(**kernels))


@pytest.mark.parametrize("head", [False, True])
def test_fp8_model_with_the_tensor_core_gemv(head):
    """The fused one-token path (norm / SiLU prologues, residual adds) and batch-4 decode through
    the tensor-core GEMV (CUDA graphs) against the same FP8 model without it; with `head` the
    model under test also has an FP8 LM head (--quantize-lm-head, through the same GEMV)."""
    off, on = _runner(fp8_mma_max_rows=0), _runner(head, fp8_mma_min_n=0)
    assert (on.model.lm_head.weight.dtype == FP8) == head
    d = Driver([off, on])
    seqs = [Seq(slot=i) for i in range(4)]
    outs = d.step([d.req(s, random_ids(40 + i, 20 + i)) for i, s in enumerate(seqs)])
    tokens = [r.next_id for r in outs[0][0]]
    for step in range(3):
        for what, batch in (("x4", seqs), ("x1", seqs[:1])):
            outs = d.step([d.req(s, [t]) for s, t in zip(batch, tokens)])
            (_, ref), (_, got) = outs
            for i, (r, g) in enumerate(zip(ref, got)):
                if r is not None:
                    assert rel_err(g, r) < 5e-2, f"decode {what} {step}[{i}]: {rel_err(g, r):.4f}"
                    assert greedy_agrees(g, r, MARGIN), f"decode {what} {step}[{i}]"
            tokens[: len(batch)] = [r.next_id for r in outs[0][0]]
