"""Serving: a request-rate sweep with Poisson arrivals.

For each rate the cache is flushed and the whole dataset is sent, request i at the i-th arrival
of a Poisson process (``inf``: all at once), at most ``--max-concurrency`` in flight. Reported per
rate: TTFT and ITL percentiles, output tok/s, req/s, and the cache hit rate next to the optimal
one of the same requests. Datasets (token ids, EOS ignored):

- ``random``: random prompts, input and output lengths uniform in
  [``--random-range-ratio`` x length, length];
- ``generated-shared-prefix``: ``--num-groups`` groups of ``--prompts-per-group`` prompts; the
  prompts of a group share a ``--system-prompt-len`` system prompt, then each has its own
  ``--question-len`` question; the order is shuffled across groups.

    python bench/serving.py --dataset generated-shared-prefix --rates 1,2,4,inf \
        --compare-no-cache --out serving.json --plot serving.png

The roofline (bench/roofline.py; ``--no-roofline`` skips it): before any server starts, a probe
(bench/ceilings.py, a subprocess on this machine) measures the device's matmul and copy-bandwidth
ceilings in the server's dtype and reads the model's shape from the server flags. Each rate's row
then carries the least time the device needs for the work the requests did (prefill FLOPs of the
prompt tokens not cached at the matmul ceiling; decode KV bytes, and the weights once per decode
step, at the copy bandwidth), with the decode steps the server reports for the run
(``roofline_run``) and with the largest batches its KV pool holds (``roofline``, the ideal), and
the output tok/s achieved as a fraction of each; and ITL p99 / ITL p50.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import queue as queue_module
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, roofline

# ---------------------------------------------------------------------------------------------
# datasets (pure)


@dataclass(frozen=True)
class BenchRequest:
    prompt: tuple[int, ...]
    output_len: int


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    token_range: tuple[int, int],
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    lo, hi = token_range

    def length(n: int) -> int:
        return int(rng.integers(max(1, int(n * range_ratio)), n + 1))

    out = []
    for _ in range(num_prompts):
        n_in, n_out = length(input_len), length(output_len)
        out.append(BenchRequest(tuple(int(t) for t in rng.integers(lo, hi, n_in)), n_out))
    return out


def shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    seed: int,
    token_range: tuple[int, int],
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    lo, hi = token_range
    out = []
    for _ in range(num_groups):
        system = [int(t) for t in rng.integers(lo, hi, system_prompt_len)]
        for _ in range(prompts_per_group):
            question = [int(t) for t in rng.integers(lo, hi, question_len)]
            out.append(BenchRequest(tuple(system + question), output_len))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def make_dataset(opts: argparse.Namespace, token_range: tuple[int, int]) -> list[BenchRequest]:
    if opts.dataset == "random":
        return random_requests(
            opts.num_prompts,
            opts.random_input_len,
            opts.random_output_len,
            opts.random_range_ratio,
            opts.seed,
            token_range,
        )
    return shared_prefix_requests(
        opts.num_groups,
        opts.prompts_per_group,
        opts.system_prompt_len,
        opts.question_len,
        opts.output_len,
        opts.seed,
        token_range,
    )


# ---------------------------------------------------------------------------------------------
# running it


async def run_rate(
    url: str,
    requests: list[BenchRequest],
    rate: float,
    opts: argparse.Namespace,
    label: str | None,
    t0: float | None = None,
) -> tuple[list[tuple[BenchRequest, common.RequestResult]], float]:
    """Every request once, paced at ``rate``; (request, result) pairs in issue order and the
    wall time. Times count from `t0` (a ``time.perf_counter()`` value; default: now); `label`
    None: no progress bar."""
    sem = asyncio.Semaphore(opts.max_concurrency or len(requests))
    pacer = common.PoissonPacer(rate, np.random.default_rng(opts.seed + 1))
    issue = itertools.count()
    done: list[tuple[int, BenchRequest, common.RequestResult]] = []
    bar = common.progress(len(requests), label) if label is not None else None
    t0 = time.perf_counter() if t0 is None else t0

    async def one(http, req: BenchRequest) -> None:
        await pacer.wait()
        async with sem:
            index = next(issue)
            result = await common.stream_generate(http, url, list(req.prompt), req.output_len, t0)
        done.append((index, req, result))
        if bar is not None:
            bar.update(1)
            if result.error is not None:
                bar.write(f"{label}: request failed: {result.error}")

    async with common.make_client(opts.api_key, min(len(requests), 1024) + 4) as http:
        await asyncio.gather(*(one(http, r) for r in requests))
    if bar is not None:
        bar.close()
    done.sort(key=lambda d: d[0])
    duration = max((r.end_s for _, _, r in done), default=0.0)
    return [(req, res) for _, req, res in done], duration


def default_client_procs() -> int:
    """Client processes for a run: one per 4 cores, at most 8 (one process's event loop parses
    about 10k streamed events a second; past that the client, not the server, sets the ITL)."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def _client_share(
    index, url, share, rate, api_key, max_concurrency, seed, barrier, queue
) -> None:  # fmt: skip
    """One client process (bench/serving.py --client-procs): its share of the requests at its
    share of the rate, times on the host's monotonic clock; back as JSON: (share index, [(the
    request's position in the share, its result)])."""
    opts = argparse.Namespace(api_key=api_key, max_concurrency=max_concurrency, seed=seed)
    requests = [BenchRequest(tuple(p), n) for p, n in share]
    position = {id(r): k for k, r in enumerate(requests)}
    barrier.wait()
    pairs, _ = common.run_async(run_rate(url, requests, rate, opts, None, t0=0.0))
    rows = [(position[id(req)], dataclasses.asdict(res)) for req, res in pairs]
    queue.put((index, msgspec.json.encode(rows).decode()))


def run_rate_procs(
    url: str, requests: list[BenchRequest], rate: float, opts: argparse.Namespace, label: str
) -> tuple[list[tuple[BenchRequest, common.RequestResult]], float]:
    """`run_rate` spread over `opts.client_procs` processes: request i goes to process
    i mod N, each paces its share at rate / N (together a Poisson process of `rate`) and bounds
    its in-flight requests by --max-concurrency / N; the pairs come back in issue order (by
    start time)."""
    procs = min(opts.client_procs or default_client_procs(), len(requests))
    if procs <= 1:
        return common.run_async(run_rate(url, requests, rate, opts, label))
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(procs + 1), ctx.Queue()
    limit = -(-opts.max_concurrency // procs) if opts.max_concurrency else None
    children = []
    for i in range(procs):
        share = [(list(r.prompt), r.output_len) for r in requests[i::procs]]
        args = (i, url, share, rate / procs, opts.api_key, limit, opts.seed + 7919 * i)
        children.append(
            ctx.Process(target=_client_share, args=(*args, barrier, queue), daemon=True)
        )
    for child in children:
        child.start()
    print(f"{label}: {len(requests)} requests from {procs} client processes", file=sys.stderr)
    try:
        barrier.wait(timeout=120)
        t0 = time.perf_counter()
        shares: dict[int, str] = {}
        while len(shares) < procs:
            try:
                index, text = queue.get(timeout=5)
                shares[index] = text
            except queue_module.Empty:
                dead = [c.exitcode for c in children if c.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process failed (exit codes {dead})") from None
    finally:
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    pairs = []
    for i, text in shares.items():
        share = requests[i::procs]
        for k, row in msgspec.json.decode(text):
            res = common.RequestResult(**row)
            res.start_s -= t0
            res.end_s -= t0
            pairs.append((share[k], res))
    pairs.sort(key=lambda p: p[1].start_s)
    return pairs, max((res.end_s for _, res in pairs), default=0.0)


def rate_summary(
    pairs: list[tuple[BenchRequest, common.RequestResult]], duration: float, page_size: int
) -> dict:
    results = [res for _, res in pairs]
    out = common.summarize(results, duration)
    optimal = common.optimal_cached_tokens(
        [(req.prompt, res.output_ids) for req, res in pairs], page_size
    )
    ok = [i for i, res in enumerate(results) if res.error is None]
    out["optimal_cached_tokens"] = sum(optimal[i] for i in ok)
    out["optimal_hit_rate"] = common.hit_rate(out["optimal_cached_tokens"], out["prompt_tokens"])
    # a result paired with the wrong request would corrupt the optimal hit rate: count them
    out["mismatched_results"] = sum(
        1 for req, res in pairs if res.error is None and res.prompt_tokens != len(req.prompt)
    )
    return out


def probe_ceilings(opts: argparse.Namespace) -> dict:
    """bench/ceilings.py in a subprocess: the device's ceilings and the model's shape, measured
    now (its memory is freed before a server is launched)."""
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "ceilings.py")]
    cmd += ["--model", opts.model, "--server-args", opts.server_args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the ceiling probe failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def roofline_summary(
    pairs: list[tuple[BenchRequest, common.RequestResult]],
    probe: dict,
    before: dict,
    after: dict,
    output_tok_s: float,
) -> dict:
    """The run's roofline (bench/roofline.py) from the work its requests did, with the decode
    steps the server reports for the run (`before` / `after`: /get_server_info around it) and
    with the largest batches its pool holds, and the fraction of each that `output_tok_s` is."""
    shape = roofline.ModelShape.from_dict(probe["shape"])
    ceilings = roofline.Ceilings(probe["matmul_TFLOPs"] * 1e12, probe["copy_TBps"] * 1e12)
    work = [
        (res.prompt_tokens, res.cached_tokens, res.output_tokens)
        for _, res in pairs
        if res.error is None
    ]
    page_size = (after.get("cache") or {}).get("page_size", 1)
    ideal_steps = roofline.ideal_decode_steps(
        [o for *_, o in work], [i + o for i, _, o in work], after["max_total_tokens"], page_size
    )
    run_steps = after.get("decode_steps", 0) - before.get("decode_steps", 0)
    ideal = roofline.workload_roofline(shape, ceilings, work, ideal_steps)
    ran = roofline.workload_roofline(shape, ceilings, work, run_steps)
    return {
        "roofline": ideal,
        "roofline_fraction": roofline.fraction(output_tok_s, ideal["output_tok_s"]),
        "roofline_run": ran,
        "roofline_run_fraction": roofline.fraction(output_tok_s, ran["output_tok_s"]),
        "roofline_serial_fraction": roofline.fraction(output_tok_s, ran["output_tok_s_serial"]),
        "retractions": after.get("retractions", 0) - before.get("retractions", 0),
        "max_running_requests": after.get("max_running_requests"),
        "pool_tokens": after["max_total_tokens"],
    }


def gc_during(before: dict, after: dict) -> dict:
    """Each server process's garbage collections during the run (/get_server_info `gc`,
    before and after it): full and long (>= 20 ms) collections, their total pause, and the
    longest pause since the server started."""
    out = {}
    for role, now in after["gc"].items():
        was = (before.get("gc") or {}).get(role) or {}
        out[role] = {
            k: now[k] - was.get(k, 0) for k in ("collections", "full_collections", "long_pauses")
        }
        out[role]["pause_s"] = now["pause_s"] - was.get("pause_s", 0.0)
        out[role]["max_pause_s_since_start"] = now["max_pause_s"]
        out[role]["frozen_objects"] = now["frozen_objects"]
    return out


def parse_rates(text: str) -> list[float]:
    rates = [math.inf if r.strip() == "inf" else float(r) for r in text.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("--rates: positive numbers or inf, comma separated")
    return rates


def run(opts: argparse.Namespace) -> dict:
    config: dict = {
        k: v for k, v in vars(opts).items() if k not in ("api_key", "out", "plot", "rates")
    }
    config["rates"] = ["inf" if math.isinf(r) else r for r in opts.rates]
    config["host"] = common.host_info()
    requests = None
    sweeps: dict[str, list[dict]] = {}
    probe = None if opts.no_roofline else probe_ceilings(opts)
    config["ceilings"] = probe
    for target in common.targets_from_args(opts):
        with common.serve_with_pid(target, opts) as (url, pid):
            info = common.prepare_server(url, opts.api_key)
            if requests is None:
                token_range = common.safe_token_range(info["vocab_size"])
                requests = make_dataset(opts, token_range)
                config.update(
                    token_range=list(token_range),
                    served_model_name=info.get("served_model_name"),
                    num_requests=len(requests),
                    input_tokens=sum(len(r.prompt) for r in requests),
                )
            server = common.server_config(info, target.url, target.flags)
            config[f"{target.label}_server"] = server
            page_size = server["page_size"]
            sweep = []
            for rate in opts.rates:
                if not common.flush_cache(url, opts.api_key):
                    print(f"warning: {url} refused /flush_cache", file=sys.stderr)
                label = f"{target.label} rate={rate:g}"
                before = common.get_server_info(url, opts.api_key)
                cpu_before = common.role_cpu_s(pid)
                pairs, duration = run_rate_procs(url, requests, rate, opts, label)
                cpu_after = common.role_cpu_s(pid)
                row = {"request_rate": "inf" if math.isinf(rate) else rate}
                row.update(rate_summary(pairs, duration, page_size))
                row["itl_p99_over_p50"] = common.ratio(row["itl_p99_s"], row["itl_p50_s"])
                after = common.get_server_info(url, opts.api_key)
                if "gc" in after:
                    row["gc"] = gc_during(before, after)
                if cpu_before is not None and cpu_after is not None and duration > 0:
                    # each launched server process's CPU time during the run per second of it
                    # (1.0 = one core busy all along: the tokenizer's event loop saturated)
                    row["server_cpu_busy"] = {
                        role: (cpu_after[role] - cpu_before[role]) / duration for role in cpu_after
                    }
                # (max_total_tokens: not behind a router (--dp), so the server's own numbers)
                if probe is not None and "max_total_tokens" in after:
                    row.update(roofline_summary(pairs, probe, before, after, row["output_tok_s"]))
                sweep.append(row)
            sweeps[target.label] = sweep
    targets = common.targets_from_args(opts)
    ceiling = {
        "cache": common.CACHE_OFF_REFERENCE if len(targets) > 1 else "none (cache on only)",
        "roofline": None
        if probe is None
        else {k: probe[k] for k in ("device", "dtype", "copy_TBps", "matmul_TFLOPs")}
        | {"measured": "bench/ceilings.py, in this run, before the server(s) started"},
    }
    return {
        "provenance": common.provenance(ceiling, common.targets_flags(targets)),
        "config": config,
        "cache_on": sweeps["cache_on"],
        "cache_off": sweeps.get("cache_off"),
    }


# ---------------------------------------------------------------------------------------------
# reporting


def print_table(result: dict) -> None:
    head = (
        f"{'rate':>6} {'server':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
        f" {'out tok/s':>9} {'req/s':>7} {'hit':>6} {'optimal':>7} {'err':>4}"
    )
    print()
    print("TTFT in s, ITL in ms")
    print(head)
    for label in ("cache_on", "cache_off"):
        for row in result[label] or []:
            print(
                f"{row['request_rate']!s:>6} {label.replace('cache_', 'cache '):>9}"
                f" {common.fmt(row['ttft_p50_s']):>9} {common.fmt(row['ttft_p99_s']):>9}"
                f" {common.fmt(row['itl_p50_s'], 1e3, 1):>8} {common.fmt(row['itl_p99_s'], 1e3, 1):>8}"
                f" {common.fmt(row['output_tok_s'], 1, 1):>9} {common.fmt(row['req_s'], 1, 2):>7}"
                f" {common.fmt(row['hit_rate']):>6} {common.fmt(row['optimal_hit_rate']):>7}"
                f" {row['errors']:>4}"
            )


def print_roofline(result: dict) -> None:
    """The ratio lines the serving goals are stated in, per server and rate."""
    probe = result["config"].get("ceilings")
    if probe:
        print(
            f"\nceilings ({probe['device']}, {probe['dtype']}, measured in this run): "
            f"matmul {probe['matmul_TFLOPs']:.4g} TFLOP/s, copy bandwidth "
            f"{probe['copy_TBps']:.4g} TB/s"
        )
    for label in ("cache_on", "cache_off"):
        for row in result[label] or []:
            name = f"{label.replace('cache_', 'cache ')} rate={row['request_rate']}"
            if "roofline" in row:
                ideal, ran = row["roofline"], row["roofline_run"]
                print(
                    f"{name}: roofline {common.fmt(ideal['output_tok_s'], 1, 0)} tok/s = prefill "
                    f"{ideal['prefill_s']:.4g} s ({ideal['prefill_flops'] / 1e12:.4g} TFLOP) + decode "
                    f"{ideal['decode_s']:.4g} s ({ideal['decode_steps']} steps of "
                    f"{common.fmt(ideal['mean_decode_batch'], 1, 1)}: "
                    f"{ideal['decode_weight_bytes'] / 1e9:.4g} GB weights + "
                    f"{ideal['decode_kv_bytes'] / 1e9:.4g} GB KV, {ideal['decode_bound']}-bound)"
                )
                print(
                    f"{name}: roofline_fraction {common.fmt(row['roofline_fraction'])}"
                    f"  (output {common.fmt(row['output_tok_s'], 1, 0)} tok/s; goal >= 0.85)"
                )
                print(
                    f"{name}: roofline_run_fraction {common.fmt(row['roofline_run_fraction'])}"
                    f"  (decode steps as run: {ran['decode_steps']}, mean batch "
                    f"{common.fmt(ran['mean_decode_batch'], 1, 1)}, roofline "
                    f"{common.fmt(ran['output_tok_s'], 1, 0)} tok/s; retractions "
                    f"{row['retractions']}; max running {row['max_running_requests']})"
                )
                print(
                    f"{name}: roofline_serial_fraction "
                    f"{common.fmt(row['roofline_serial_fraction'])}  (the run's decode steps "
                    f"with one kernel at a time: {common.fmt(ran['output_tok_s_serial'], 1, 0)} "
                    f"tok/s)"
                )
            print(f"{name}: itl_p99_over_p50 {common.fmt(row['itl_p99_over_p50'])}  (goal <= 3)")
            if row.get("gc"):
                parts = [
                    f"{role} {g['full_collections']} full, {g['long_pauses']} >= 20 ms "
                    f"(max {g['max_pause_s_since_start'] * 1e3:.1f} ms)"
                    for role, g in row["gc"].items()
                ]
                print(f"{name}: gc during the run: " + "; ".join(parts))
            if row.get("server_cpu_busy"):
                busy = ", ".join(f"{k} {v:.2f}" for k, v in row["server_cpu_busy"].items())
                print(f"{name}: server processes' CPU time per second of the run: {busy}")


def plot(result: dict, path: str) -> None:
    plt = common.pyplot()
    cfg = result["config"]
    labels = [str(r) for r in cfg["rates"]]
    x = list(range(len(labels)))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    series = [("cache on", result["cache_on"], "tab:blue")]
    if result["cache_off"]:
        series.append(("cache off", result["cache_off"], "tab:red"))

    def values(rows: list[dict], key: str) -> list[float]:
        return [math.nan if r[key] is None else r[key] for r in rows]

    ax = axes[0]
    for name, rows, color in series:
        ax.plot(x, values(rows, "ttft_p50_s"), "o-", color=color, label=f"{name} p50")
        ax.plot(x, values(rows, "ttft_p99_s"), "--", color=color, alpha=0.6, label=f"{name} p99")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("time to first token")
    ax = axes[1]
    for name, rows, color in series:
        ax.plot(x, values(rows, "output_tok_s"), "o-", color=color, label=name)
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput")
    ax = axes[2]
    ax.plot(x, values(result["cache_on"], "optimal_hit_rate"), "s--", color="gray", label="optimal")
    for name, rows, color in series:
        ax.plot(x, values(rows, "hit_rate"), "o-", color=color, label=name)
    ax.set_ylabel("cached prompt tokens / prompt tokens")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("cache hit rate")
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylim(bottom=0)
    fig.suptitle(
        f"{cfg.get('served_model_name')}: dataset {cfg['dataset']}, "
        f"{cfg.get('num_requests')} requests, {cfg.get('input_tokens')} prompt tokens",
        fontsize=10,
    )
    common.save_figure(fig, path)


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = common.server_bench_parser(__doc__)
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=["random", "generated-shared-prefix"], default="random")
    w.add_argument("--rates", type=parse_rates, default=parse_rates("1,2,4"), help="req/s; inf ok")
    w.add_argument("--max-concurrency", type=int, default=None, help="default: unbounded")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--client-procs",
        type=int,
        default=None,
        help="client processes sending the requests (default: one per 4 cores, at most 8)",
    )
    r = p.add_argument_group("random dataset")
    r.add_argument("--num-prompts", type=int, default=32)
    r.add_argument("--random-input-len", type=int, default=256)
    r.add_argument("--random-output-len", type=int, default=64)
    r.add_argument("--random-range-ratio", type=float, default=0.5)
    g = p.add_argument_group("generated-shared-prefix dataset")
    g.add_argument("--num-groups", type=int, default=4)
    g.add_argument("--prompts-per-group", type=int, default=8)
    g.add_argument("--system-prompt-len", type=int, default=512)
    g.add_argument("--question-len", type=int, default=64)
    g.add_argument("--output-len", type=int, default=64)
    w.add_argument(
        "--no-roofline",
        action="store_true",
        help="skip the ceiling probe and the roofline (bench/ceilings.py, bench/roofline.py)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", help="write the results as JSON here")
    o.add_argument("--plot", help="write a PNG plot here")
    return p


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    common.exit_on_sigterm()
    result = run(opts)
    print_table(result)
    print_roofline(result)
    if opts.out:
        common.write_json(opts.out, result)
    if opts.plot:
        plot(result, opts.plot)
    return common.exit_code([*result["cache_on"], *(result["cache_off"] or [])])


if __name__ == "__main__":
    sys.exit(main())
