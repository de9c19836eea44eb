"""bench/multi_turn_chat.py's host-tier runs: which servers it launches and the goals' ratios."""

from __future__ import annotations

from bench import multi_turn_chat as mtc


def _opts(*flags, **kw):
    argv = ["--server-args", "--load-format dummy --max-total-tokens 800", *flags]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return mtc.build_parser().parse_args(argv)


def test_targets_add_one_run_per_policy_and_the_unrestricted_pool():
    opts = _opts("--compare-no-cache", "--hicache-args=--hicache-ratio 4",
                 hicache_policies="write_through,write_back", unrestricted_tokens=9000)  # fmt: skip
    targets = {t.label: t.flags for t in mtc.all_targets(opts)}
    assert list(targets) == [
        "cache_on", "cache_off", "hicache_write_through", "hicache_write_back", "unrestricted",
    ]  # fmt: skip
    wt = targets["hicache_write_through"]
    assert wt[-5:] == ("--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
                       "--hicache-ratio", "4")  # fmt: skip
    unr = targets["unrestricted"]
    assert unr.count("--max-total-tokens") == 1 and unr[-1] == "9000"
    assert list(mtc.all_targets(_opts())) == mtc.all_targets(_opts())[:1]
    # --skip-device-only: the tiered runs and the unrestricted pool only (a lone run stays)
    opts = _opts("--skip-device-only", hicache_policies="write_through", unrestricted_tokens=9000)
    assert [t.label for t in mtc.all_targets(opts)] == ["hicache_write_through", "unrestricted"]
    assert [t.label for t in mtc.all_targets(_opts("--skip-device-only"))] == ["cache_on"]


def test_tier_ratios():
    def sec(hit, ttft, tok, cache=None):
        return {"hit_rate": hit, "optimal_hit_rate": 0.8, "ttft_p50_s": ttft,
                "output_tok_s": tok, "prompt_tokens": 1000, "server_cache": cache or {}}  # fmt: skip

    sections = {
        "cache_on": sec(0.4, 0.2, 50),
        "hicache_write_through": sec(
            0.79,
            0.11,
            95,
            {
                "host_cached_tokens": 300,
                "host_loaded_bytes": 3e9,
                "host_written_bytes": 1e9,
                "host_load_s": 0.1,
                "host_load_bandwidth": 4e10,
                "host_load_runs": 1000,
                "host_write_runs": 0,
            },
        ),  # fmt: skip
        "unrestricted": sec(0.8, 0.1, 100),
    }
    out = mtc.tier_ratios(sections, _opts())
    row = out["hicache_write_through"]
    assert abs(row["hit_rate_over_optimal"] - 0.79 / 0.8) < 1e-9
    assert abs(row["ttft_p50_over_unrestricted"] - 1.1) < 1e-9
    assert abs(row["output_tok_s_over_unrestricted"] - 0.95) < 1e-9
    assert row["host_hit_rate"] == 0.3
    assert abs(row["load_throughput_over_copy_bandwidth"] - 3e10 / 4e10) < 1e-9
    assert row["load_bytes_per_run"] == 3e6 and "write_bytes_per_run" not in row
    assert out["pinned_h2d_bandwidth"] is None  # no host-tier runs asked: not measured


def test_host_copy_bench_writes_its_ratios(tmp_path):
    import json

    from bench import host_copy

    out = tmp_path / "host_copy.json"
    argv = ["--device", "cpu", "--pages", "8", "--layers", "2", "--kv-heads", "1",
            "--head-dim", "8", "--run-lengths", "1,4", "--repeats", "1", "--out", str(out)]  # fmt: skip
    assert host_copy.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["provenance"]["ceiling"].startswith("a plain contiguous copy")
    assert data["config"]["batch_bytes"] == 8 * data["config"]["page_bytes"]
    assert set(data["results"]) == {"run_1", "run_4"}
    assert data["results"]["run_4"]["runs"] == 2
    for row in data["results"].values():
        for k in ("load", "write", "previous_load", "previous_write"):
            assert row[f"{k}_over_copy"] > 0
    # --ops: only those (and the copy they are judged against)
    assert host_copy.main([*argv[:-2], "--ops", "load", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["results"]["run_4"]
    assert sorted(k for k in row if k.endswith("_over_copy")) == ["load_over_copy"]


def test_host_ids_are_distinct_runs():
    import numpy as np

    from bench.host_copy import host_ids

    ids = host_ids(10, 4, 41, np.random.default_rng(0))
    assert len(ids) == len(set(ids.tolist())) == 10 and ids.min() >= 1 and ids.max() <= 40
    assert sum(np.diff(ids) == 1) >= 6  # runs of 4, 4 and 2 consecutive pages


def test_the_optimum_is_against_the_answers_the_server_computed():
    """A replayed run's next prompt holds the first run's answer; where the server generated
    another answer no cache could hold those tokens: the optimum stops where they differ."""
    from bench import common

    system, first = [7] * 8, [9] * 4
    turns = [
        mtc.Turn(0, 0, 0, system + first, [1, 2, 3, 4],  # the replayed answer
                 common.RequestResult(output_ids=[1, 2, 5, 6])),  # what the server generated
        mtc.Turn(0, 1, 1, system + first + [1, 2, 3, 4] + [8], [],
                 common.RequestResult(output_ids=[3])),
    ]  # fmt: skip
    assert mtc.optimal_per_turn(turns, page_size=1) == [0, 14]
    # the live run (answers = what it generated) can hit the whole previous turn
    turns[0].result.output_ids = [1, 2, 3, 4, 0]
    assert mtc.optimal_per_turn(turns, page_size=1) == [0, 16]
