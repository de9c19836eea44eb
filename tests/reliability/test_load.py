"""Load: N requests at 50 in flight complete with zero errors, twice; the resident memory of every
process is stable from the first round to the second.

The full case (1,000 requests a round, minutes on a 2-core machine) runs only with
RADIX_RUNTIME_LOAD_TEST=1; a 200-request version always runs.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
from reliability_support import assert_no_leak, processes, record, rss_mb, wait_idle

pytestmark = pytest.mark.slow

FULL = os.environ.get("RADIX_RUNTIME_LOAD_TEST") == "1"
IN_FLIGHT = 50
MAX_TOKENS = 4
# growth from round 1 to round 2 that still counts as stable, per process
RSS_SLACK_MB, RSS_SLACK_FRACTION = 50.0, 0.10


def _prompt(i: int) -> str:
    return f"Request {i}: name a fruit that starts with the letter {chr(65 + i % 26)}."


async def _round(url: str, requests: int) -> tuple[int, list, float]:
    """All requests, IN_FLIGHT at a time; returns (completed, errors, seconds)."""
    limits = httpx.Limits(max_connections=IN_FLIGHT, max_keepalive_connections=IN_FLIGHT)
    gate = asyncio.Semaphore(IN_FLIGHT)
    errors: list = []
    done = 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal done
        async with gate:
            try:
                r = await client.post(
                    "/v1/completions",
                    json={"prompt": _prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0},
                )
                choice = r.json()["choices"][0] if r.status_code == 200 else None
                if choice is None or choice["finish_reason"] not in ("stop", "length"):
                    errors.append((i, r.status_code, r.text[:200]))
                else:
                    done += 1
            except Exception as exc:
                errors.append((i, None, repr(exc)))

    started = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client, i) for i in range(requests)))
    return done, errors, time.monotonic() - started


@pytest.mark.parametrize(
    "requests",
    [
        200,
        pytest.param(
            1000,
            marks=pytest.mark.skipif(
                not FULL, reason="the full load test: RADIX_RUNTIME_LOAD_TEST=1"
            ),
        ),
    ],
)
def test_load_rounds_memory_stable(default_server, requests):
    h = default_server
    procs = processes(h)
    rounds = []
    for _ in range(2):
        done, errors, seconds = asyncio.run(_round(h.url, requests))
        with h.client() as c:
            wait_idle(c)
        rounds.append({"done": done, "errors": errors, "s": seconds, "rss": rss_mb(procs)})
    assert_no_leak(h)
    first, second = rounds[0]["rss"], rounds[1]["rss"]
    record(
        f"load: {requests} requests x 2 rounds, {IN_FLIGHT} in flight",
        errors=sum(len(r["errors"]) for r in rounds),
        round_s=" / ".join(f"{r['s']:.1f}" for r in rounds),
        req_per_s=" / ".join(f"{requests / r['s']:.1f}" for r in rounds),
        rss_mb_round1=_fmt(first),
        rss_mb_round2=_fmt(second),
    )
    for r in rounds:
        assert not r["errors"], r["errors"][:5]
        assert r["done"] == requests
    for role in procs:
        growth = second[role] - first[role]
        assert growth < max(RSS_SLACK_MB, RSS_SLACK_FRACTION * first[role]), (role, first, second)


def _fmt(rss: dict[str, float]) -> str:
    return ", ".join(f"{role} {mb:.0f}" for role, mb in rss.items())
