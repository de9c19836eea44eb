"""bench/burst_replay.py: a burst through the real scheduler with a modelled step time; the
replay follows the scheduling flags as the server does (prefill-first, the interleave cap, mixed
chunks), so its step counts and token intervals move with them."""

from __future__ import annotations

import json

from bench import burst_replay

# 8 prompts of 64 tokens, one prompt per prefill step (chunk 64), 16 outputs each
SMALL = [
    "--num-prompts", "8", "--input-len", "64", "--output-len", "16", "--pool", "4096",
    "--fixed-ms", "4", "--prefill-fixed-ms", "3", "--prefill-us-per-token", "500",
]  # fmt: skip


def _run(*flags: str) -> dict:
    opts = burst_replay.build_parser().parse_args(
        [*SMALL, "--server-args=--chunked-prefill-size 64 " + " ".join(flags)]
    )
    return burst_replay.replay(opts)


def test_prefill_first_stalls_early_decoders_for_the_whole_burst():
    r = _run()
    assert r["prefill_steps"] == 8 and r["mixed_steps"] == 0 and r["retractions"] == 0
    assert r["decode_steps"] == 15  # every request decodes in lockstep after the last prefill
    assert r["intervals"] == 8 * 15
    prefill_s = (3 + 64 * 0.5) / 1e3
    # the first request waits for the prefill steps after its own before its second token
    assert r["itl_max_s"] >= 6 * prefill_s


def test_the_interleave_cap_bounds_a_decoders_wait_to_one_prefill_step():
    r = _run("--max-consecutive-prefill-steps 1")
    assert r["prefill_steps"] == 8 and r["mixed_steps"] == 0
    assert r["decode_steps"] > 15  # decode steps between the prefill steps
    decode_max_s = (4 + 8 * 80 * 131072 / 4.2e12 * 1e3 * 1.15) / 1e3
    # (the overlap schedule may plan one more prefill step before a decoder's first token is in)
    assert r["itl_max_s"] <= 2 * (3 + 64 * 0.5) / 1e3 + decode_max_s


def test_mixed_chunks_put_decodes_beside_prefills(tmp_path):
    out = tmp_path / "r.json"
    assert (
        burst_replay.main(
            [
                *SMALL,
                "--server-args=--enable-mixed-chunk --chunked-prefill-size 64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["result"]["mixed_steps"] > 0
    assert doc["provenance"]["commit"] and doc["config"]["num_prompts"] == 8
