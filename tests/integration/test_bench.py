"""The benchmark scripts, run as a user would (subprocesses), at tiny sizes against CPU servers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EPS = 1e-9

SECTION_FIELDS = (
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "output_tok_s",
    "req_s",
    "hit_rate",
    "optimal_hit_rate",
)
PER_ROUND_FIELDS = ("ttft_p50_s", "ttft_p90_s", "hit_rate", "optimal_hit_rate")


# Generous: on 2 busy cores a decode step of the default model can take a second or more.
TIMEOUT_S = 400


def run_script(script: str, *args: str, timeout: float = TIMEOUT_S) -> str:
    """Run a benchmark script; its stdout. On a timeout it gets SIGINT, so that it stops the
    servers it launched, before the test fails."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{script} ran over {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"{script} failed:\n{out[-4000:]}\n{err[-4000:]}"
    return out


def check_png(path: Path) -> None:
    assert path.exists() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_section(sec: dict, requests: int, rounds: int | None = None) -> None:
    for key in SECTION_FIELDS:
        assert isinstance(sec[key], float), key
    assert sec["requests"] == requests and sec["errors"] == 0
    assert 0 < sec["ttft_p50_s"] <= sec["ttft_p90_s"] <= sec["ttft_p99_s"]
    assert 0 < sec["itl_p50_s"] <= sec["itl_p99_s"]
    assert sec["output_tok_s"] > 0 and sec["req_s"] > 0
    assert 0 <= sec["hit_rate"] <= sec["optimal_hit_rate"] + EPS <= 1 + EPS
    if rounds is not None:
        for key in PER_ROUND_FIELDS:
            assert len(sec["per_round"][key]) == rounds, key
        for got, best in zip(sec["per_round"]["hit_rate"], sec["per_round"]["optimal_hit_rate"]):
            assert got <= best + EPS


def test_multi_turn_chat_cache_on_and_off(tmp_path):
    """Launch mode: a server with the cache, then one with --disable-radix-cache, same trace
    (token ids: the tiny model with dummy weights serves them at a fraction of the cost)."""
    out, png = tmp_path / "mt.json", tmp_path / "mt.png"
    stdout = run_script(
        "multi_turn_chat.py",
        "--compare-no-cache",
        "--model", "tiny-llama",
        "--server-args", "--load-format dummy --model-config tiny-llama --max-total-tokens 16384 "
                         "--page-size 4",
        "--clients", "3",
        "--rounds", "2",
        "--system-tokens", "64",
        "--context-tokens", "16",
        "--user-tokens", "8",
        "--answer-tokens", "8",
        "--out", str(out),
        "--plot", str(png),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert "hit rate" in stdout and "cache off" in stdout
    cfg = result["config"]
    assert (cfg["clients"], cfg["rounds"], cfg["answer_tokens"]) == (3, 2, 8)
    assert cfg["cache_on_server"]["page_size"] == 4
    # the scheduling settings each server ran with, as it reported them (defaults included)
    from radix_runtime.config import ServerArgs

    for label, no_cache in (("cache_on", False), ("cache_off", True)):
        server = cfg[f"{label}_server"]
        assert server["disable_radix_cache"] is no_cache
        assert server["chunked_prefill_size"] == ServerArgs().chunked_prefill_size
        assert server["disable_overlap_schedule"] is False
        assert server["radix_tree"] in ("cpp", "python")
    on, off = result["cache_on"], result["cache_off"]
    check_section(on, 6, rounds=2)
    check_section(off, 6, rounds=2)
    for sec in (on, off):  # the client's own event-loop lag is reported beside the latencies
        assert 0 <= sec["client_loop_lag_p50_ms"] <= sec["client_loop_lag_p99_ms"]
        # the server's /metrics split of the run's TTFTs: each request queued and prefilled once
        times = sec["scheduler"]
        assert times["queue_time_count"] == times["prefill_time_count"] == 6
        assert 0 <= times["queue_time_mean_s"] < times["time_to_first_token_mean_s"]
    # every answer is exactly --answer-tokens long (EOS ignored)
    assert on["output_tokens"] == off["output_tokens"] == 6 * 8
    # the same prompts went to both servers
    assert on["prompt_tokens"] == off["prompt_tokens"]
    assert on["optimal_hit_rate"] == pytest.approx(off["optimal_hit_rate"])
    assert on["hit_rate"] > 0.3
    assert off["hit_rate"] == 0.0
    assert on["per_round"]["hit_rate"][1] > on["per_round"]["hit_rate"][0]
    ratios = result["ratios"]
    assert set(ratios) == {
        "ttft_p50_off_over_on",
        "output_tok_s_on_over_off",
        "hit_rate_over_optimal",
    }
    assert all(isinstance(v, float) and v > 0 for v in ratios.values())
    assert ratios["hit_rate_over_optimal"] <= 1 + EPS
    check_png(png)


def test_multi_turn_chat_text_mode_paced(default_server, tmp_path):
    """--url mode, chat text instead of token ids, one request in flight, Poisson arrivals."""
    out, png = tmp_path / "mt_text.json", tmp_path / "mt_text.png"
    run_script(
        "multi_turn_chat.py",
        "--url", default_server.url,
        "--text",
        "--clients", "2",
        "--rounds", "2",
        "--system-tokens", "48",
        "--context-tokens", "8",
        "--user-tokens", "8",
        "--answer-tokens", "4",
        "--max-inflight", "1",
        "--request-rate", "50",
        "--out", str(out),
        "--plot", str(png),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["cache_off"] is None
    check_section(result["cache_on"], 4, rounds=2)
    assert result["cache_on"]["output_tokens"] == 4 * 4
    assert result["cache_on"]["hit_rate"] > 0.3
    assert result["ratios"]["ttft_p50_off_over_on"] is None
    assert result["ratios"]["hit_rate_over_optimal"] > 0
    check_png(png)


# (dataset flags, rates): the random dataset sweeps two rates, the shared-prefix one sends at once
DATASETS = {
    "random": (
        ("--num-prompts", "3", "--random-input-len", "24", "--random-output-len", "6",
         "--client-procs", "2"),
        ("16,inf", [16.0, "inf"]),
    ),
    "generated-shared-prefix": (
        ("--num-groups", "2", "--prompts-per-group", "3", "--system-prompt-len", "48",
         "--question-len", "8", "--output-len", "4", "--no-roofline"),
        ("inf", ["inf"]),
    ),
}  # fmt: skip


@pytest.mark.parametrize("dataset", list(DATASETS))
def test_serving_sweep(default_server, tmp_path, dataset):
    flags, (rates, expected_rates) = DATASETS[dataset]
    out, png = tmp_path / "serving.json", tmp_path / "serving.png"
    stdout = run_script(
        "serving.py",
        "--url", default_server.url,
        "--dataset", dataset,
        *flags,
        "--rates", rates,
        "--out", str(out),
        "--plot", str(png),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["config"]["dataset"] == dataset
    assert result["config"]["rates"] == expected_rates
    assert result["cache_off"] is None
    rows = result["cache_on"]
    assert [r["request_rate"] for r in rows] == expected_rates
    n = 3 if dataset == "random" else 6
    for row in rows:
        check_section(row, n)
        assert row["itl_p99_over_p50"] >= 1
        assert row["mismatched_results"] == 0
        # each server process's garbage collections during the run (/get_server_info gc)
        assert set(row["gc"]) == {"tokenizer", "scheduler", "worker"}
        assert all(
            g["frozen_objects"] > 0 and g["full_collections"] >= 0 for g in row["gc"].values()
        )
    if dataset == "random":
        # the roofline from the ceilings measured in the run and the work the requests did
        ceilings = result["config"]["ceilings"]
        assert ceilings["device"] == "cpu" and ceilings["matmul_TFLOPs"] > 0
        assert result["provenance"]["ceiling"]["roofline"]["copy_TBps"] == ceilings["copy_TBps"]
        for row in rows:
            ideal, ran = row["roofline"], row["roofline_run"]
            assert ideal["output_tokens"] == row["output_tokens"]
            assert 0 < ideal["decode_steps"] <= ran["decode_steps"]  # the ideal batches are larger
            assert ideal["output_tok_s"] >= ran["output_tok_s"]
            assert 0 < row["roofline_fraction"] <= row["roofline_run_fraction"]
            # one kernel at a time is never faster than the overlapped bound (equal, up to
            # rounding, when every kernel is bandwidth-bound)
            assert ran["output_tok_s_serial"] <= ran["output_tok_s"] * (1 + 1e-9)
            assert row["roofline_run_fraction"] <= row["roofline_serial_fraction"] * (1 + 1e-9)
        assert stdout.count(": roofline_fraction ") == len(rows)
        assert stdout.count(": roofline_serial_fraction ") == len(rows)
        assert stdout.count(": roofline_run_fraction ") == len(rows)
        assert stdout.count("itl_p99_over_p50") == len(rows)
        assert stdout.count(": gc during the run: tokenizer ") == len(rows)
    else:
        assert result["config"]["ceilings"] is None and "roofline" not in rows[0]
    if dataset == "generated-shared-prefix":
        # 4 of 6 prompts share a 48-token system prompt: at least 4 * 48 / (6 * 56)
        assert all(r["optimal_hit_rate"] >= 4 * 48 / (6 * 56) - EPS for r in rows)
        assert all(r["hit_rate"] > 0.3 for r in rows)
    check_png(png)


def test_front_stream_freezes_the_fronts_startup_objects_unless_told_not_to(tmp_path):
    """bench/front_stream.py: the real HTTP front fed by a paced scheduler script, measured by
    bench/serving.py; the front's garbage collections come back in the results."""
    for flags, frozen in (("", True), ("--disable-gc-freeze", False)):
        out = tmp_path / f"front_{frozen}.json"
        stdout = run_script(
            "front_stream.py",
            "--streams", "8", "--step-ms", "10", "--num-prompts", "8",
            "--input-len", "16", "--output-len", "12",
            f"--server-args={flags}", "--out", str(out),
        )  # fmt: skip
        row = json.loads(out.read_text())["cache_on"][0]
        assert row["errors"] == 0 and row["output_tokens"] == 8 * 12
        assert (row["gc"]["tokenizer"]["frozen_objects"] > 1000) == frozen
        assert ": gc during the run: tokenizer " in stdout and "itl_p99_over_p50" in stdout
