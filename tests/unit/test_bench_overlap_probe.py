"""bench/overlap_probe.py's host-side logic: the KV layout of its requests, the per-layer work it
divides by, and the results rebuilt from a run's printed log (ratios and summary)."""

from __future__ import annotations

import json

import pytest

from bench import overlap_probe as op

LOG = """\
ceilings: {'copy_TBps': 4.2, 'matmul_TFLOPs': 760.0, 'sms': 132}
  page 1 attn256_ms: 400.0 us/layer  [3 s]
  page 1 serial512_ms: 1000.0 us/layer
  page 1 serial2x256_ms: 1100.0 us/layer
  page 1 nano2x256_ms: 1045.0 us/layer
  page 1 free2x256_ms: 990.0 us/layer
  page 1 nano2x256_gemm_hi_prio_ms: 1210.0 us/layer
  page 1 gemm256_carve32_ms: 206.1 us/layer
  page 1 plan_split512: FAILED ValueError: no
[W1202 07:45:46 Context.cpp:632] Warning: anything else in the log is skipped
  page 16 attn256_ms: 380.0 us/layer
  page 16 nano2x256_ms: 900.0 us/layer
"""


def test_kv_layout_pages_and_last_page_length():
    assert op.kv_layout(4, 1537, 1) == ([1537] * 4, [1] * 4, 4 * 1537)
    # 1,537 tokens in pages of 16: 96 full pages and one holding a single token
    assert op.kv_layout(2, 1537, 16) == ([97, 97], [1, 1], 194)
    assert op.kv_layout(3, 32, 16) == ([2, 2, 2], [16, 16, 16], 6)


def test_layer_work_is_the_8b_layer():
    # Llama-3.1-8B: 218,103,808 weights per decoder layer (qkv 6144x4096, o, gate_up, down)
    assert op.layer_weight_bytes() == 2 * 218_103_808
    assert op.layer_gemm_flops(256) == 2.0 * 256 * 218_103_808


def test_parse_log_rebuilds_rows_ratios_and_summary():
    res = op.parse_log(LOG)
    assert res["page_sizes"] == [1, 16]
    assert res["ceilings"] == {"copy_TBps": 4.2, "matmul_TFLOPs": 760.0, "sms": 132}
    p1 = res["page1"]
    assert p1["attn256_ms"] == pytest.approx(0.4)  # us in the log, ms in the results
    assert "plan_split512" not in p1  # a failure line is not a timing
    assert p1["concurrent_over_serial"] == pytest.approx(1045 / 1100)
    assert p1["nano_over_serial512"] == pytest.approx(1045 / 1000)
    assert p1["concurrent_over_serial_gemm_hi_prio"] == pytest.approx(1210 / 1100)
    assert "concurrent_over_serial_carve32" not in p1  # no nano row for that variant
    s1 = res["summary"]["page1"]
    # the best nano-batched schedule (free2x256 is not a valid schedule: never "best")
    assert s1["best_nano_variant"] == "nano2x256_ms"
    assert s1["best_nano_step_ms"] == pytest.approx(1.045 * op.MODEL_LAYERS)
    assert s1["serial512_step_ms"] == pytest.approx(1.0 * op.MODEL_LAYERS)
    assert s1["best_nano_over_serial512"] == pytest.approx(1.045)
    # page 16 stopped early: no serial rows, so no ratios, but the rows it has are kept
    p16, s16 = res["page16"], res["summary"]["page16"]
    assert p16["nano2x256_ms"] == pytest.approx(0.9)
    assert "concurrent_over_serial" not in p16
    assert s16["best_concurrent_over_serial"] is None and s16["serial512_step_ms"] is None


def test_from_log_writes_a_reconstructed_results_file(tmp_path, monkeypatch, capsys):
    log, out = tmp_path / "run.log", tmp_path / "out.json"
    log.write_text(LOG)
    monkeypatch.setattr("sys.argv", ["overlap_probe.py", "--from-log", str(log), "--out", str(out)])
    op.main()
    data = json.loads(out.read_text())
    assert data["provenance"]["reconstructed"] is True
    assert data["page1"]["serial2x256_ms"] == pytest.approx(1.1)
    assert "page 1: concurrent / serial 0.950 (best nano2x256_ms: 0.950)" in capsys.readouterr().out


def test_the_committed_h200_probe_result_is_consistent():
    """docs/results/h200_overlap_probe.json: its rows are its log's, re-derived."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs/results/h200_overlap_probe.json"
    data = json.loads(path.read_text())
    rebuilt = op.parse_log("\n".join(data["log"]))
    for ps in data["page_sizes"]:
        assert data[f"page{ps}"] == rebuilt[f"page{ps}"]
    assert data["summary"] == rebuilt["summary"]
