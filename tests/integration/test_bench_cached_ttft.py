"""bench/cached_ttft.py run as a user would, against the shared CPU server: the cached request
really hits the cache, and the result carries its provenance."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration.test_bench import run_script

pytestmark = pytest.mark.slow


def test_cached_ttft_through_the_server(default_server, tmp_path):
    out = tmp_path / "ttft.json"
    stdout = run_script(
        "cached_ttft.py",
        "--url", default_server.url,
        "--prompt-tokens", "160",
        "--new-tokens", "16",
        "--repeats", "2",
        "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert "speedup" in stdout
    pairs = result["pairs"]
    assert len(pairs) == 2
    for pair in pairs:
        assert pair["cold_cached_tokens"] == 0  # a fresh random prompt
        assert pair["cached_cached_tokens"] == 160 - 16  # all but the replaced tail (page size 1)
        assert pair["cold_ttft_s"] > 0 and pair["cached_ttft_s"] > 0
    assert result["cached_tokens"] == 144
    assert result["cached_ttft_speedup"] == pytest.approx(
        result["cold_ttft_ms"] / result["cached_ttft_ms"]
    )
    prov = result["provenance"]
    assert prov["reconstructed"] is False
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert prov["commit"] == head.stdout.strip()
    assert "bench/cached_ttft.py" in prov["command"] and "--prompt-tokens 160" in prov["command"]
    assert prov["server_flags"] == {"cache_on": f"a running server at {default_server.url}"}
    assert prov["machine"]["cpu_model"] and prov["machine"]["cpus"] >= 1
    assert "cold TTFT" in prov["ceiling"]
    assert result["config"]["server"]["page_size"] == 1
