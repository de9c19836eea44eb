"""bench/gpu_worker.py's ceilings and ratio definitions on the GPU: the read-bandwidth ceiling is
measured, lies between a copy's and the spec, and the fractions divide by what they say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")

from bench import gpu_worker  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "h200_gpu_worker.json"


def test_the_read_ceiling_is_a_plausible_streaming_rate():
    read = gpu_worker.read_bandwidth_TBps(rows=32768, cols=4096, copies=8)  # 2 GB of weights
    assert read > 0.5
    spec = gpu_worker.SPECS.get(torch.cuda.get_device_name())
    if spec is not None:
        assert read < spec[0] * 1.02  # no faster than the HBM can go: not served from L2


def test_the_fractions_reproduce_the_recorded_ratios():
    """The committed H200 result, recomputed from its own inputs with today's definitions."""
    r = json.loads(RESULTS.read_text())
    w = r["weight_GB_per_decode_step"] * 1e9
    out = gpu_worker.bandwidth_fractions("decode_bs1", w, r["decode_bs1_ms"], r)
    assert out["decode_bs1_roofline_fraction"] == pytest.approx(r["decode_bs1_roofline_fraction"])
    assert out["decode_bs1_read_bw_fraction"] == pytest.approx(r["decode_bs1_read_bw_fraction"])
    assert out["decode_bs1_spec_fraction"] == pytest.approx(r["decode_bs1_spec_fraction"])
    # the copy ceiling is the lowest of the three, so its fraction is the highest
    assert (
        out["decode_bs1_roofline_fraction"]
        > out["decode_bs1_read_bw_fraction"]
        > out["decode_bs1_spec_fraction"]
    )
