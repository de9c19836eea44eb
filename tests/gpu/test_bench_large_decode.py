"""bench/gpu_worker.py's large decode step on a tiny model: its roofline ratio divides what it
says, graph and eager are both measured, and the phase breakdown finds the step's phases."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")

from gpu_support import cuda_runner  # noqa: E402

from bench import gpu_worker  # noqa: E402


@pytest.mark.parametrize("page_size", [1, 16])
def test_large_decode_reports_roofline_graph_eager_and_phases(page_size):
    runner = cuda_runner(page_size=page_size, max_total_tokens=16384, cuda_graph_max_bs=8)
    bench = gpu_worker.Bench(runner)
    w_bytes = gpu_worker.weight_bytes_per_decode_step(runner)
    c = runner.config
    kv = runner.kv_pool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, runner.dtype)
    copy_bps = 1e12
    out = gpu_worker.large_decode(bench, 8, 256, w_bytes, kv, copy_bps)
    key = "decode_bs8_ctx256"
    roof_ms = (w_bytes + out[f"{key}_kv_GB"] * 1e9) / copy_bps * 1e3
    assert out[f"{key}_roofline_ms"] == pytest.approx(roof_ms)
    assert out[f"{key}_roofline_ratio"] == pytest.approx(out[f"{key}_ms"] / roof_ms)
    assert out[f"{key}_graph_bs"] == 8 and out[f"{key}_graph_replay_ms"] > 0
    assert out[f"{key}_eager_ms"] > 0 and out[f"{key}_host_prepare_ms"] > 0
    for path in ("graph", "eager"):
        phases = out[f"{key}_profile_{path}"]["phases_us"]
        assert {"matmul", "attention"} <= set(phases), phases
    # larger than the captured graphs: the step runs eager and says so
    wide = gpu_worker.large_decode(bench, 12, 128, w_bytes, kv, copy_bps)
    assert wide["decode_bs12_ctx128_graph_bs"] is None
    assert runner.cuda_graphs is not None  # restored after the eager measurements
