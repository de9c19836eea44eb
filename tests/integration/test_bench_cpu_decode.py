"""bench/cpu_decode.py's split of our cached turn's TTFT (cached_turn_parts) against the shared
CPU server's real /metrics: every part is there, the parts fit inside the server's TTFT, and
the front is the client's TTFT minus the server's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds bench/

from bench import cpu_decode  # noqa: E402
from bench.cpu_decode import cached_turn_parts, ttft_parts  # noqa: E402
from bench.multi_turn_chat import TTFT_PARTS  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_cached_turn_splits_into_the_servers_parts_and_the_front(default_server):
    parts = cached_turn_parts(default_server.url, "test split")
    assert parts is not None
    assert set(parts) == {"client_ttft", *TTFT_PARTS, "front"}
    assert all(v >= 0 for v in parts.values())
    server = parts["time_to_first_token"]
    assert parts["front"] == pytest.approx(parts["client_ttft"] - server)
    inside = sum(parts[k] for k in TTFT_PARTS[1:])  # disjoint intervals of the server's TTFT
    assert 0 < inside <= server * 1.05 + 1.0
    assert parts["prefill_time"] > 0  # the cached turn's chunk ran a step


def test_a_server_without_our_metrics_gives_no_split(monkeypatch):
    assert ttft_parts(0.05, None) is None
    assert ttft_parts(0.05, {"time_to_first_token_mean_s": None}) is None
    # llama.cpp's server: no /metrics of ours, so no extra turn is sent to it
    monkeypatch.setattr(cpu_decode, "scheduler_times", lambda url, key: None)

    def no_request(*args):
        raise AssertionError("a request was sent")

    monkeypatch.setattr(cpu_decode, "complete", no_request)
    monkeypatch.setattr(cpu_decode, "stream", no_request)
    assert cached_turn_parts("http://127.0.0.1:9", "peer") is None
