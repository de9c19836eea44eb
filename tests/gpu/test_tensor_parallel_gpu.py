"""`--tp 2` on two GPUs: NCCL all-reduces, captured in the decode and prefill CUDA graphs, give
what one GPU gives (tests/unit/test_tensor_parallel.py checks the same over gloo on the CPU).

Two rank processes (tests/tp_support.py, one GPU each) run the overlap schedule's steps; the
reference is one worker on GPU 0 in this process.
- float32 (the torch attention backend, no graphs): the same tokens, logits to float32 rounding;
- bfloat16 (FlashInfer, CUDA graphs capturing the NCCL all-reduces: the logits come from the
  prefill graph's replay, the decode steps from the decode graph's): logits to bf16 rounding and
  the same greedy token wherever the reference's top two logits are not within that rounding.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)

from tp_support import run_ranks, run_steps, runner_args  # noqa: E402

from radix_runtime import messages as m  # noqa: E402
from radix_runtime.worker.model_runner import ModelRunner  # noqa: E402

MODEL = "dummy:tiny-llama"


def _reference(dtype: str) -> dict:
    runner = ModelRunner(runner_args(MODEL, "cuda", 1, dtype))
    try:
        return run_steps(runner)
    finally:
        del runner
        torch.cuda.empty_cache()


def test_nccl_float32_equals_one_gpu(tmp_path):
    got = run_ranks(
        [MODEL], str(tmp_path), env={"TP_TEST_DEVICE": "cuda", "TP_TEST_DTYPE": "float32"}
    )[MODEL]
    want = _reference("float32")
    for g, w in zip(got["results"], want["results"]):
        g, w = m.decode(g), m.decode(w)
        assert [r.next_id for r in g.results] == [r.next_id for r in w.results]
    for g, w in zip(got["logits"], want["logits"]):
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_nccl_in_cuda_graphs_bf16(tmp_path):
    pytest.importorskip("flashinfer")
    got = run_ranks(
        [MODEL], str(tmp_path), env={"TP_TEST_DEVICE": "cuda", "TP_TEST_DTYPE": "bfloat16"}
    )[MODEL]
    want = _reference("bfloat16")
    assert got["cuda_graphs"] and want["cuda_graphs"]
    assert got["kv_heads"] == want["kv_heads"] // 2
    for g, w in zip(got["logits"], want["logits"]):
        if w is None:
            continue
        torch.testing.assert_close(g, w, rtol=0.05, atol=0.05)
        top2 = w.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1  # rows whose argmax bf16 rounding cannot flip
        assert torch.equal(g.argmax(-1)[clear], w.argmax(-1)[clear])
