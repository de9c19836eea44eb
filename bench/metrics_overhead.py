"""The cost of metrics: the multi-turn chat workload against a server with metrics on (the
default) and one started with --disable-metrics, in one run, interleaved.

Both servers are up for the whole run and take turns: each repeat runs the same trace (the
second arm replays the first arm's answers, so the prompts are identical) against both, in
alternating order (on/off, off/on, ...), each from an emptied cache. While the metrics-on
arm runs, /metrics is scraped every --scrape-interval seconds (Prometheus scrapes every 5-15 s
by default; 1 s is a heavier load), so the cost of serving scrapes is in the number too. The
result is the output tok/s ratio on/off per repeat, their median and spread; the goal is >= 0.99.

On a shared, busy machine wall-clock throughput swings by tens of percent between runs, far more
than the cost being measured. So for servers it launches, the benchmark also records the CPU
time each server process (tokenizer/HTTP, scheduler, worker) spent per arm: the metrics code
runs in the tokenizer and scheduler processes, and their CPU seconds per output token, on vs
off, is the cost itself, much less sensitive to other load than tok/s.

    python bench/metrics_overhead.py --repeats 3 --clients 8 --rounds 4 \\
        --server-args "--max-total-tokens 65536" --out docs/results/metrics_overhead_cpu.json
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import statistics
import sys
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common
from bench import multi_turn_chat as mtc

ARMS = ("metrics_on", "metrics_off")


async def _scrape_while(url: str, api_key: str | None, interval: float, done: asyncio.Event):
    """Scrape /metrics every `interval` s until `done`; (scrapes, failures)."""
    ok = failed = 0
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        while not done.is_set():
            try:
                r = await http.get(url + "/metrics")
                ok += r.status_code == 200
                failed += r.status_code != 200
            except httpx.HTTPError:
                failed += 1
            try:
                await asyncio.wait_for(done.wait(), interval)
            except TimeoutError:
                pass
    return ok, failed


async def _arm(url: str, trace, opts, label: str, replay, scrape: bool):
    done = asyncio.Event()
    scraper = (
        asyncio.create_task(_scrape_while(url, opts.api_key, opts.scrape_interval, done))
        if scrape
        else None
    )
    try:
        turns, duration, lag = await mtc.run_trace(url, trace, opts, label, replay)
    finally:
        done.set()
    scrapes = await scraper if scraper is not None else (0, 0)
    return turns, duration, lag, scrapes


def run(opts) -> dict:
    flags = tuple(shlex.split(opts.server_args))
    targets = {
        "metrics_on": common.Target("metrics_on", opts.url, tuple(f for f in flags)),
        "metrics_off": common.Target(
            "metrics_off",
            opts.url_no_metrics,
            flags if "--disable-metrics" in flags else (*flags, "--disable-metrics"),
        ),
    }
    runs: list[dict] = []
    config = {
        k: v
        for k, v in vars(opts).items()
        if k not in ("api_key", "out", "plot", "url_no_cache", "compare_no_cache")
    }
    config["host"] = common.host_info()
    with contextlib.ExitStack() as stack:
        urls, pids = {}, {}
        for arm in ARMS[::-1] if opts.launch_off_first else ARMS:
            urls[arm], pids[arm] = stack.enter_context(common.serve_with_pid(targets[arm], opts))
        infos = {arm: common.prepare_server(u, opts.api_key) for arm, u in urls.items()}
        if infos["metrics_off"].get("disable_metrics") is not True:
            raise SystemExit("the metrics_off server does not run with --disable-metrics")
        info = infos["metrics_on"]
        token_range = common.safe_token_range(info["vocab_size"])
        trace = mtc.make_trace(
            opts.clients, opts.rounds, opts.system_tokens, opts.context_tokens,
            opts.user_tokens, opts.seed, token_range,
        )  # fmt: skip
        mtc.check_fits(
            mtc.max_prompt_tokens(
                opts.rounds, opts.system_tokens, opts.context_tokens, opts.user_tokens,
                opts.answer_tokens,
            ) + opts.answer_tokens,
            info,
        )  # fmt: skip
        for arm in ARMS:
            config[f"{arm}_server"] = common.server_config(
                infos[arm], targets[arm].url, targets[arm].flags
            )
        replay = None
        for rep in range(opts.repeats):
            order = ARMS if rep % 2 == 0 else ARMS[::-1]
            pair = {}
            for arm in order:
                url = urls[arm]
                if not common.flush_cache(url, opts.api_key):
                    raise SystemExit(f"{url} refused /flush_cache")
                cpu0 = common.role_cpu_s(pids[arm])
                turns, duration, lag, (scrapes, failed) = common.run_async(
                    _arm(url, trace, opts, f"{arm} #{rep}", replay, arm == "metrics_on")
                )
                cpu1 = common.role_cpu_s(pids[arm])
                if replay is None:
                    replay = {
                        (t.client, t.round): t.answer for t in turns if t.result.error is None
                    }
                sec = mtc.section(turns, duration, opts.rounds, None) | lag
                sec.pop("per_round")
                sec.update(scrapes=scrapes, scrape_failures=failed)
                if cpu0 is not None:
                    sec["cpu_s"] = {r: cpu1[r] - cpu0[r] for r in common.ROLES}
                    front = sec["cpu_s"]["tokenizer"] + sec["cpu_s"]["scheduler"]
                    sec["front_cpu_ms_per_output_token"] = (
                        1e3 * front / max(sec["output_tokens"], 1)
                    )
                pair[arm] = sec
                print(
                    f"repeat {rep} {arm:<12} output {sec['output_tok_s']:.1f} tok/s, "
                    f"TTFT p50 {sec['ttft_p50_s']:.3f} s, {sec['errors']} errors, "
                    f"{scrapes} scrapes",
                    file=sys.stderr,
                )
            pair["ratio_output_tok_s"] = common.ratio(
                pair["metrics_on"]["output_tok_s"], pair["metrics_off"]["output_tok_s"]
            )
            cpu_ratio = (
                common.ratio(
                    pair["metrics_on"]["front_cpu_ms_per_output_token"],
                    pair["metrics_off"]["front_cpu_ms_per_output_token"],
                )
                if "cpu_s" in pair["metrics_on"]
                else None
            )
            if cpu_ratio is not None:  # None: no CPU time was read for the servers' processes
                pair["ratio_front_cpu_per_token"] = cpu_ratio
            pair["order"] = list(order)
            runs.append(pair)
    ratios = [r["ratio_output_tok_s"] for r in runs]
    total = {
        arm: sum(r[arm]["output_tokens"] for r in runs) / sum(r[arm]["duration_s"] for r in runs)
        for arm in ARMS
    }
    cpu = [r["ratio_front_cpu_per_token"] for r in runs if "ratio_front_cpu_per_token" in r]
    pooled_cpu = share = None
    if cpu:

        def front(sec: dict) -> float:
            return sec["cpu_s"]["tokenizer"] + sec["cpu_s"]["scheduler"]

        # the CPU work metrics add (front on - front off, per token) over all the work a token
        # costs without them (every process): what a CPU-bound server loses in tok/s
        added = sum(
            front(r["metrics_on"]) / r["metrics_on"]["output_tokens"]
            - front(r["metrics_off"]) / r["metrics_off"]["output_tokens"]
            for r in runs
        )
        whole = sum(sum(r["metrics_off"]["cpu_s"].values()) / r["metrics_off"]["output_tokens"]
                    for r in runs)  # fmt: skip
        share = added / whole if whole > 0 else None  # no CPU times read (processes not found)
        pooled_cpu = {
            arm: 1e3
            * sum(r[arm]["cpu_s"]["tokenizer"] + r[arm]["cpu_s"]["scheduler"] for r in runs)
            / sum(r[arm]["output_tokens"] for r in runs)
            for arm in ARMS
        }
    return {
        "provenance": common.provenance(
            "the same trace against a server with --disable-metrics, interleaved in the same run",
            common.targets_flags(list(targets.values())),
        ),
        "config": config,
        "runs": runs,
        "summary": {
            "ratio_output_tok_s_median": statistics.median(ratios),
            "ratio_output_tok_s_min": min(ratios),
            "ratio_output_tok_s_max": max(ratios),
            "ratio_output_tok_s_pooled": total["metrics_on"] / total["metrics_off"],
            "output_tok_s_pooled": total,
            # tokenizer + scheduler CPU per output token, on / off (launched servers only)
            "ratio_front_cpu_per_token_median": statistics.median(cpu) if cpu else None,
            "ratio_front_cpu_per_token_min": min(cpu) if cpu else None,
            "ratio_front_cpu_per_token_max": max(cpu) if cpu else None,
            "front_cpu_ms_per_output_token_pooled": pooled_cpu,
            "ratio_front_cpu_per_token_pooled": (
                pooled_cpu["metrics_on"] / pooled_cpu["metrics_off"] if pooled_cpu else None
            ),
            # added tokenizer+scheduler CPU per token / all processes' CPU per token without
            # metrics, and the tok/s ratio that implies for a CPU-bound server
            "metrics_cpu_share": share,
            "cpu_bound_tok_s_ratio_estimate": 1 / (1 + share) if share is not None else None,
            "errors": sum(r[a]["errors"] for r in runs for a in ARMS),
            "scrape_failures": sum(r["metrics_on"]["scrape_failures"] for r in runs),
            "goal": ">= 0.99",
        },
    }


def build_parser():
    p = mtc.build_parser()
    p.description = __doc__.split("\n\n")[0]
    g = p.add_argument_group("metrics overhead")
    g.add_argument("--url-no-metrics", help="a running server started with --disable-metrics")
    g.add_argument("--repeats", type=int, default=3, help="pairs of runs (alternating order)")
    g.add_argument(
        "--scrape-interval", type=float, default=1.0, help="seconds between /metrics scrapes"
    )
    g.add_argument(
        "--launch-off-first",
        action="store_true",
        help="launch the --disable-metrics server first (to see an effect of launch order)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    common.exit_on_sigterm()
    if opts.compare_no_cache or opts.url_no_cache:
        raise SystemExit("this benchmark compares metrics on/off; the cache is on in both")
    if opts.max_inflight is None:
        opts.max_inflight = opts.clients
    result = run(opts)
    s = result["summary"]
    print()
    print(
        f"{'repeat':<8}{'order':<26}{'on tok/s':>10}{'off tok/s':>11}{'on/off':>8}"
        f"{'front CPU ms/tok on':>21}{'off':>6}{'on/off':>8}"
    )
    for i, r in enumerate(result["runs"]):
        on, off = r["metrics_on"], r["metrics_off"]
        line = (
            f"{i:<8}{' then '.join(r['order']):<26}{on['output_tok_s']:>10.1f}"
            f"{off['output_tok_s']:>11.1f}{r['ratio_output_tok_s']:>8.3f}"
        )
        if "ratio_front_cpu_per_token" in r:
            line += (
                f"{on['front_cpu_ms_per_output_token']:>21.2f}"
                f"{off['front_cpu_ms_per_output_token']:>6.2f}"
                f"{r['ratio_front_cpu_per_token']:>8.3f}"
            )
        print(line)
    print(
        f"\noutput tok/s on/off: median {s['ratio_output_tok_s_median']:.3f} "
        f"(min {s['ratio_output_tok_s_min']:.3f}, max {s['ratio_output_tok_s_max']:.3f}; "
        f"pooled {s['ratio_output_tok_s_pooled']:.3f}); goal >= 0.99"
    )
    if s["ratio_front_cpu_per_token_median"] is not None:
        print(
            f"tokenizer+scheduler CPU per output token on/off: median "
            f"{s['ratio_front_cpu_per_token_median']:.3f} (min "
            f"{s['ratio_front_cpu_per_token_min']:.3f}, max "
            f"{s['ratio_front_cpu_per_token_max']:.3f}; pooled "
            f"{s['ratio_front_cpu_per_token_pooled']:.3f})"
        )
        print(
            f"CPU metrics add per token / all CPU per token: {s['metrics_cpu_share']:.4f} "
            f"-> CPU-bound tok/s ratio {s['cpu_bound_tok_s_ratio_estimate']:.4f}"
        )
    if opts.out:
        common.write_json(opts.out, result)
    if s["errors"] or s["scrape_failures"]:
        print(
            f"error: {s['errors']} requests, {s['scrape_failures']} scrapes failed", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
