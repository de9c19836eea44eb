"""bench/radix_tree.py with the host tier (--host-fraction): both trees replay the same trace,
load from the host, and reach the same hit rates; the results carry the tier's ops."""

from __future__ import annotations

import json

import pytest

from bench import radix_tree

pytest.importorskip("radix_runtime.scheduler.radix_cache_cpp", reason="the C++ tree is not built")


@pytest.mark.parametrize("write_through", [False, True])
def test_host_tier_trace_on_both_trees(tmp_path, write_through):
    out = tmp_path / "tree.json"
    argv = [
        "--clients", "6", "--rounds", "4", "--system-len", "64", "--user-len", "16",
        "--output-len", "16", "--in-flight", "2", "--pool-fraction", "0.3",
        "--host-fraction", "1.0", "--repeats", "1", "--reps", "5", "--no-progress",
        "--json", str(out),
    ] + (["--write-through"] if write_through else [])  # fmt: skip
    radix_tree.main(argv)
    result = json.loads(out.read_text())
    assert result["config"]["write_through"] is write_through
    py, cc = result["python"]["trace"], result["cpp"]["trace"]
    for key in ("hit_rate", "host_hit_rate", "evicted_pages", "host_pages"):
        assert py[key] == cc[key]
    assert cc["host_hit_rate"] > 0 and cc["evicted_pages"] > 0
    assert cc["hit_rate"] > cc["host_hit_rate"]  # device hits too
    assert cc["ops"]["load"]["count"] > 0 and cc["ops"]["copies"]["count"] > 0


def test_without_the_host_tier_nothing_is_loaded(tmp_path):
    out = tmp_path / "tree.json"
    radix_tree.main(
        [
            "--clients",
            "4",
            "--rounds",
            "3",
            "--system-len",
            "64",
            "--user-len",
            "16",
            "--output-len",
            "16",
            "--in-flight",
            "2",
            "--repeats",
            "1",
            "--reps",
            "5",
            "--impl",
            "cpp",
            "--no-progress",
            "--json",
            str(out),
        ]  # fmt: skip
    )
    trace = json.loads(out.read_text())["cpp"]["trace"]
    assert "host_pages" not in trace and "load" not in trace["ops"]
