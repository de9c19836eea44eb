"""bench/admission_replay.py: a multi-turn trace through the scheduler alone counts, per pool,
the steps from a turn's arrival to its first token and the admissions refused for memory."""

from __future__ import annotations

import json

from bench import admission_replay

SMALL = ["--clients", "4", "--rounds", "2", "--system-tokens", "16", "--context-tokens", "16",
         "--user-tokens", "4", "--answer-tokens", "4", "--max-inflight", "2",
         "--radix-tree-impl", "python"]  # fmt: skip


def test_a_pool_that_holds_the_turns_in_flight_admits_them_at_once(tmp_path):
    out = tmp_path / "replay.json"
    argv = [*SMALL, "--pool", "120", "--unrestricted-tokens", "4096", "--out", str(out)]
    assert admission_replay.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["provenance"]["command"]
    for label in ("hicache", "unrestricted"):
        run = data[label]
        assert run["turns"] == 8 and run["admissions_refused"] == 0
        assert run["min_page_margin_at_admission"] >= 0
        assert [r["steps_to_first_token_max"] for r in run["per_round"]][1] <= 3
    assert data["hicache"]["host_loads"] > 0  # the turns' histories came back from the host
    assert data["hicache"]["hit_rate"] == data["unrestricted"]["hit_rate"] > 0


def test_a_pool_too_small_for_the_turns_in_flight_makes_them_wait(tmp_path):
    out = tmp_path / "replay.json"
    argv = [*SMALL, "--pool", "48", "--unrestricted-tokens", "0", "--out", str(out)]
    assert admission_replay.main(argv) == 0
    run = json.loads(out.read_text())["hicache"]
    assert "unrestricted" not in json.loads(out.read_text())
    assert run["admissions_refused"] > 0
    assert max(r["steps_to_first_token_max"] for r in run["per_round"]) > 3
