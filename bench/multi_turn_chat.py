"""Multi-turn chat: the benchmark a radix cache is for.

N clients hold R-round conversations that all start with the same system prompt. A client's
prompt in round r is its prompt of round r-1, the answer it got (the server's actual output
ids), and a new user turn; so with a prefix cache almost every prompt token was computed
before. Rounds of different clients interleave: a client sends round r+1 only after round r
finished, and the clients run concurrently, at most ``--max-inflight`` requests at a time, in a
closed loop or paced by a Poisson ``--request-rate``.

The same trace runs against the server with the cache on, and with ``--compare-no-cache`` against
one started with ``--disable-radix-cache`` (that run replays the first run's answers, so both send
the very same prompts). Next to the measured hit rate stands the optimal one: the hit rate of
the same trace against an infinite cache.

    python bench/multi_turn_chat.py --clients 8 --rounds 4 --compare-no-cache \
        --server-args "--max-total-tokens 65536" --out result.json --plot result.png

The host KV tier (docs/hicache.md): ``--hicache-policies write_through,write_back`` adds one run
per write policy with ``--enable-hierarchical-cache`` (and ``--hicache-args``) on the same
device pool, ``--unrestricted-tokens N`` a run whose device pool holds N tokens (the reference:
nothing evicted). Each such run records per round the tokens loaded from the host and the bytes
that moved; the result compares the tiered runs with the unrestricted one and their load
throughput with a host-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common

# ---------------------------------------------------------------------------------------------
# the trace (pure)


@dataclass(frozen=True)
class ChatTrace:
    """The random parts of a workload; the answers come from the server while it runs."""

    system: tuple[int, ...]  # shared by every client
    contexts: tuple[tuple[int, ...], ...]  # [client]: the client's own first-turn material
    user_turns: tuple[tuple[tuple[int, ...], ...], ...]  # [client][round]

    @property
    def clients(self) -> int:
        return len(self.contexts)

    @property
    def rounds(self) -> int:
        return len(self.user_turns[0]) if self.user_turns else 0


def make_trace(
    clients: int,
    rounds: int,
    system_tokens: int,
    context_tokens: int,
    user_tokens: int,
    seed: int,
    token_range: tuple[int, int],
) -> ChatTrace:
    """Random token ids in ``token_range`` ([lo, hi)), the same for the same arguments."""
    rng = np.random.default_rng(seed)
    lo, hi = token_range

    def ids(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(lo, hi, size=n))

    system = ids(system_tokens)
    contexts = tuple(ids(context_tokens) for _ in range(clients))
    user_turns = tuple(tuple(ids(user_tokens) for _ in range(rounds)) for _ in range(clients))
    return ChatTrace(system, contexts, user_turns)


def build_prompt(trace: ChatTrace, client: int, answers: Sequence[Sequence[int]]) -> list[int]:
    """The prompt of ``client``'s round ``len(answers)``: system + context + user turn 0, then
    for each earlier round its answer and the next user turn."""
    turns = trace.user_turns[client]
    ids = [*trace.system, *trace.contexts[client], *turns[0]]
    for r, answer in enumerate(answers):
        ids += answer
        ids += turns[r + 1]
    return ids


# Text mode renders every token id as one of these words (most are one token in any vocabulary).
_WORD_LIST = (
    "the of and to in is you that it he was for on are as with his they at be this have from or "
    "one had by word but not what all were we when your can said there use an each which she do "
    "how their if will up other about out many then them these so some her would make like him "
    "into time has look two more write go see number no way could people my than first water been "
    "call who oil its now find long down day did get come made may part"
)
WORDS = tuple(_WORD_LIST.split())


def to_text(ids: Sequence[int]) -> str:
    return " ".join(WORDS[t % len(WORDS)] for t in ids)


def build_messages(trace: ChatTrace, client: int, answers: Sequence[str]) -> list[dict]:
    """Text mode: the same conversation as chat messages (``answers`` are the reply texts)."""
    turns = trace.user_turns[client]
    first = to_text(trace.contexts[client]) + "\n\n" + to_text(turns[0])
    messages = [
        {"role": "system", "content": to_text(trace.system)},
        {"role": "user", "content": first},
    ]
    for r, answer in enumerate(answers):
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": to_text(turns[r + 1])})
    return messages


def max_prompt_tokens(
    rounds: int, system_tokens: int, context_tokens: int, user_tokens: int, answer_tokens: int
) -> int:
    return system_tokens + context_tokens + rounds * user_tokens + (rounds - 1) * answer_tokens


# ---------------------------------------------------------------------------------------------
# running it


@dataclass
class Turn:
    """One request as issued."""

    client: int
    round: int
    issue_index: int
    prompt: list[int] | list[dict]  # token ids, or chat messages in text mode
    answer: list[int] | str  # what the next round appends: output ids, or text
    result: common.RequestResult


async def run_trace(
    url: str,
    trace: ChatTrace,
    opts: argparse.Namespace,
    label: str,
    replay: dict[tuple[int, int], list[int] | str] | None = None,
) -> tuple[list[Turn], float, dict]:
    """All clients' conversations against ``url``; the turns in issue order, the wall time and
    the client's event-loop lag (common.LoopLag).
    ``replay`` ((client, round) -> answer) makes the conversations use those answers instead of
    the ones the server gives, so a second run sends the very same prompts."""
    sem = asyncio.Semaphore(opts.max_inflight)
    pacer = common.PoissonPacer(opts.request_rate, np.random.default_rng(opts.seed + 1))
    issue = itertools.count()
    turns: list[Turn] = []
    bar = common.progress(trace.clients * trace.rounds, label)
    t0 = time.perf_counter()

    async def client_loop(http, client: int) -> None:
        answers: list = []
        for r in range(trace.rounds):
            if replay is not None and (client, r) not in replay:
                return  # the replayed run failed here: so does this one
            if opts.text:
                prompt = build_messages(trace, client, answers)
            else:
                prompt = build_prompt(trace, client, answers)
            await pacer.wait()
            async with sem:
                index = next(issue)
                if opts.text:
                    result = await common.stream_chat(http, url, prompt, opts.answer_tokens, t0)
                else:
                    result = await common.stream_generate(http, url, prompt, opts.answer_tokens, t0)
            answer = result.text if opts.text else result.output_ids
            if replay is not None:
                answer = replay[(client, r)]
            turns.append(Turn(client, r, index, prompt, answer, result))
            bar.update(1)
            if result.error is not None:
                bar.write(f"{label}: client {client} round {r} failed: {result.error}")
                return  # its later prompts would need this answer
            answers.append(answer)

    lag = common.LoopLag()
    lag.start()
    async with common.make_client(opts.api_key, opts.max_inflight + 4) as http:
        await asyncio.gather(*(client_loop(http, c) for c in range(trace.clients)))
    duration = max((t.result.end_s for t in turns), default=0.0)
    bar.close()
    turns.sort(key=lambda t: t.issue_index)
    return turns, duration, lag.stop()


def optimal_per_turn(turns: Sequence[Turn], page_size: int, tokenizer=None) -> list[int] | None:
    """Optimal cached tokens per turn (issue order): against what the server computed, i.e.
    each prompt and the answer the server generated for it. A replayed run (every target after
    the first) sends the first run's answers in its next prompts; where its own greedy answer
    differed (dummy weights give near-tied logits, and batching changes the last bits) no cache
    could hold the replayed tokens. Text mode tokenizes the chat prompts with the model's
    tokenizer (None if there is none) and the answers as plain text."""
    if tokenizer is None and turns and isinstance(turns[0].answer, str):
        return None
    pairs = []
    for t in turns:
        if tokenizer is not None:
            prompt = tokenizer.encode_chat(t.prompt)
            answer = tokenizer.encode(t.result.text, add_special_tokens=False)
        else:
            prompt, answer = t.prompt, t.result.output_ids
        pairs.append((prompt, answer))
    return common.optimal_cached_tokens(pairs, page_size)


def section(turns: list[Turn], duration: float, rounds: int, optimal: list[int] | None) -> dict:
    """The metrics of one run, overall and per round."""
    results = [t.result for t in turns]
    out = common.summarize(results, duration)
    ok = [i for i, t in enumerate(turns) if t.result.error is None]
    if optimal is not None:
        out["optimal_cached_tokens"] = sum(optimal[i] for i in ok)
        out["optimal_hit_rate"] = common.hit_rate(
            out["optimal_cached_tokens"], out["prompt_tokens"]
        )
    else:
        out["optimal_cached_tokens"] = out["optimal_hit_rate"] = None
    per_round: dict[str, list] = {
        k: []
        for k in (
            "ttft_p50_s",
            "ttft_p90_s",
            "ttft_mean_s",
            "itl_p50_s",
            "prompt_tokens_mean",
            "hit_rate",
            "optimal_hit_rate",
        )
    }
    per_round["host_hit_rate"] = []
    for r in range(rounds):
        idx = [i for i in ok if turns[i].round == r]
        host = sum(turns[i].result.host_cached_tokens for i in idx)
        per_round["host_hit_rate"].append(
            common.hit_rate(host, sum(turns[i].result.prompt_tokens for i in idx))
        )
        ttfts = [turns[i].result.ttft_s for i in idx]
        itls = [x for i in idx for x in turns[i].result.itls_s]
        prompt = sum(turns[i].result.prompt_tokens for i in idx)
        cached = sum(turns[i].result.cached_tokens for i in idx)
        per_round["ttft_p50_s"].append(common.percentile(ttfts, 50))
        per_round["ttft_p90_s"].append(common.percentile(ttfts, 90))
        per_round["ttft_mean_s"].append(float(np.mean(ttfts)) if ttfts else None)
        per_round["itl_p50_s"].append(common.percentile(itls, 50))
        per_round["prompt_tokens_mean"].append(prompt / len(idx) if idx else None)
        per_round["hit_rate"].append(common.hit_rate(cached, prompt))
        per_round["optimal_hit_rate"].append(
            common.hit_rate(sum(optimal[i] for i in idx), prompt) if optimal is not None else None
        )
    out["per_round"] = per_round
    return out


def load_tokenizer(info: dict):
    try:
        from radix_runtime.tokenizer import load_tokenizer as load

        return load(info.get("tokenizer") or info.get("model") or info["model_path"])
    except Exception as exc:  # any failure only costs the optimal hit rate of text mode
        print(f"warning: no local tokenizer ({exc}); text mode has no optimal hit rate")
        return None


def base_config(opts: argparse.Namespace) -> dict:
    config: dict = {
        k: v for k, v in vars(opts).items() if k not in ("api_key", "out", "plot", "func")
    }
    config["request_rate"] = "inf" if math.isinf(opts.request_rate) else opts.request_rate
    config["host"] = common.host_info()
    config["max_prompt_tokens"] = max_prompt_tokens(
        opts.rounds, opts.system_tokens, opts.context_tokens, opts.user_tokens, opts.answer_tokens
    )
    return config


def run_targets(targets: list, opts: argparse.Namespace, config: dict) -> dict[str, dict]:
    """The same trace against each target in turn (later ones replay the first one's answers,
    so every target sees the very same prompts); a section of metrics per target label."""
    sections: dict[str, dict] = {}
    trace = None
    replay = None
    for target in targets:
        with common.open_target(target, opts) as url:
            # behind a router, warm-ups with different prompts reach several replicas
            info = common.prepare_server(url, opts.api_key, warm_ups=2 * max(opts.dp, 1))
            if trace is None:
                token_range = common.safe_token_range(info["vocab_size"])
                trace = make_trace(
                    opts.clients,
                    opts.rounds,
                    opts.system_tokens,
                    opts.context_tokens,
                    opts.user_tokens,
                    opts.seed,
                    token_range,
                )
                check_fits(config["max_prompt_tokens"] + opts.answer_tokens, info)
                config.update(
                    token_range=list(token_range),
                    served_model_name=info.get("served_model_name"),
                    vocab_size=info["vocab_size"],
                    context_length=info.get("context_length"),
                )
            server = common.server_config(info, target.url, target.flags)
            config[f"{target.label}_server"] = server
            page_size = server["page_size"]
            before = scheduler_times(url, opts.api_key)
            turns, duration, lag = common.run_async(
                run_trace(url, trace, opts, target.label, replay)
            )
            after = scheduler_times(url, opts.api_key)
            tokenizer = load_tokenizer(info) if opts.text else None
            optimal = optimal_per_turn(turns, page_size, tokenizer)
            sections[target.label] = section(turns, duration, opts.rounds, optimal) | lag
            tier_stats(sections[target.label], turns, opts.rounds, url, opts.api_key)
            sections[target.label]["scheduler"] = times_delta(before, after)
            if info.get("router"):  # counted since each replica started: warm-ups included
                sections[target.label]["replicas"] = common.replica_split(url, opts.api_key)
            if replay is None:
                replay = {(t.client, t.round): t.answer for t in turns if t.result.error is None}
    return sections


def run(opts: argparse.Namespace) -> dict:
    config = base_config(opts)
    targets = all_targets(opts)
    sections = run_targets(targets, opts, config)
    on, off = sections.get("cache_on"), sections.get("cache_off")
    reference = common.CACHE_OFF_REFERENCE if off else "none (cache on only)"
    if "unrestricted" in sections:
        reference = (
            f"the same workload with an unrestricted device pool (--max-total-tokens "
            f"{opts.unrestricted_tokens}) in the same run; " + reference
        )
    extra = {k: v for k, v in sections.items() if k not in ("cache_on", "cache_off")}
    return {
        "provenance": common.provenance(reference, common.targets_flags(targets)),
        "config": config,
        "cache_on": on,
        "cache_off": off,
        **extra,
        "tiers": tier_ratios(sections, opts),
        "ratios": {
            "ttft_p50_off_over_on": common.ratio(
                off and off["ttft_p50_s"], on and on["ttft_p50_s"]
            ),
            "output_tok_s_on_over_off": common.ratio(
                on and on["output_tok_s"], off and off["output_tok_s"]
            ),
            "hit_rate_over_optimal": common.ratio(
                on and on["hit_rate"], on and on["optimal_hit_rate"]
            ),
        },
    }


ROUTER_REFERENCE = (
    "the optimal hit rate: the same trace against one infinite cache (what perfect affinity "
    "would reuse); the policies side by side on the same trace, in the same run"
)


def run_router_policies(opts: argparse.Namespace) -> dict:
    """`--router-policies a,b`: one launched `serve --dp N --router-policy P` per policy, the
    same trace against each: hit rate over optimal, TTFT and throughput side by side."""
    policies = [p.strip() for p in opts.router_policies.split(",") if p.strip()]
    if opts.url:
        raise SystemExit("--router-policies launches its servers: leave out --url")
    flags = tuple(shlex.split(opts.server_args))
    targets = [
        common.Target(p, None, (*flags, "--dp", str(opts.dp), "--router-policy", p))
        for p in policies
    ]
    config = base_config(opts)
    sections = run_targets(targets, opts, config)
    first = policies[0]
    ratios = {
        f"{p}_hit_rate_over_optimal": common.ratio(
            sections[p]["hit_rate"], sections[p]["optimal_hit_rate"]
        )
        for p in policies
    }
    for p in policies[1:]:
        ratios[f"output_tok_s_{first}_over_{p}"] = common.ratio(
            sections[first]["output_tok_s"], sections[p]["output_tok_s"]
        )
        ratios[f"ttft_p50_{p}_over_{first}"] = common.ratio(
            sections[p]["ttft_p50_s"], sections[first]["ttft_p50_s"]
        )
    return {
        "provenance": common.provenance(ROUTER_REFERENCE, common.targets_flags(targets)),
        "config": config,
        "policies": sections,
        "ratios": ratios,
    }


# the metric tables' rows: section key -> (row name, scale, digits)
METRICS = {
    "ttft_p50_s": ("TTFT p50 (s)", 1, 3),
    "ttft_p90_s": ("TTFT p90 (s)", 1, 3),
    "ttft_p99_s": ("TTFT p99 (s)", 1, 3),
    "itl_p50_s": ("ITL p50 (ms)", 1e3, 1),
    "itl_p99_s": ("ITL p99 (ms)", 1e3, 1),
    "output_tok_s": ("output tok/s", 1, 1),
    "req_s": ("requests/s", 1, 3),
    "hit_rate": ("hit rate", 1, 3),
    "optimal_hit_rate": ("optimal hit rate", 1, 3),
    "errors": ("errors", 1, 0),
    "client_loop_lag_p99_ms": ("client lag p99 ms", 1, 1),
}
POLICY_METRICS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "output_tok_s", "hit_rate",
                  "optimal_hit_rate", "errors")  # fmt: skip


def print_metrics(
    sections: dict[str, dict], keys, width: int, ratio_head: str | None = None
) -> None:
    """A row per metric in `keys`, a column per section; `ratio_head`: one more column, the
    second section over the first."""
    heads = list(sections) + ([ratio_head] if ratio_head else [])
    print()
    print(f"{'':<18}" + "".join(f"{h:>{width}}" for h in heads))
    for key in keys:
        name, scale, digits = METRICS[key]
        cells = [common.fmt(sec[key], scale, digits) for sec in sections.values()]
        if ratio_head:
            first, second = sections.values()
            cells.append(common.fmt(common.ratio(second[key], first[key]), 1, 2))
        print(f"{name:<18}" + "".join(f"{c:>{width}}" for c in cells))


def print_policy_table(result: dict) -> None:
    sections = result["policies"]
    print_metrics(sections, POLICY_METRICS, width=14)
    print()
    for key, value in result["ratios"].items():
        print(f"{key + ':':<44}{common.fmt(value, 1, 3)}")
    for policy, sec in sections.items():
        split = sec.get("replicas") or []
        shares = ", ".join(f"{r['prompt_tokens']} ({r['cached_tokens']} cached)" for r in split)
        print(f"{policy}: prompt tokens per replica: {shares}")


def all_targets(opts: argparse.Namespace) -> list[common.Target]:
    """cache_on (the device-only cache), cache_off, then one host-tier run per write policy and
    the unrestricted pool, all with --server-args (launched servers only)."""
    targets = common.targets_from_args(opts)
    base = targets[0].flags
    for policy in filter(None, (opts.hicache_policies or "").split(",")):
        flags = (*base, "--enable-hierarchical-cache", "--hicache-write-policy", policy)
        flags = (*flags, *shlex.split(opts.hicache_args))
        targets.append(common.Target(f"hicache_{policy}", None, flags))
        if opts.compare_prefetch_off:  # the same, loading host hits with the first chunk
            flags = (*flags, "--hicache-prefetch", "off")
            targets.append(common.Target(f"hicache_{policy}_no_prefetch", None, flags))
    if opts.unrestricted_tokens:
        flags = list(base)
        if "--max-total-tokens" in flags:
            i = flags.index("--max-total-tokens")
            del flags[i : i + 2]
        flags += ["--max-total-tokens", str(opts.unrestricted_tokens)]
        targets.append(common.Target("unrestricted", None, tuple(flags)))
    if opts.skip_device_only and len(targets) > 1 and not targets[0].url:
        # the tier's goals compare the tiered runs with the unrestricted pool only
        targets = [t for t in targets if t.label != "cache_on"]
    return targets


def tier_stats(sec: dict, turns: list[Turn], rounds: int, url: str, api_key) -> None:
    """The server's cache section after the run (host pages, hits, bytes loaded and written,
    load time) and, per round, the bytes loaded from the host."""
    cache = common.get_server_info(url, api_key).get("cache") or {}
    sec["server_cache"] = cache
    sec["host_loaded_requests"] = sum(1 for t in turns if t.result.host_cached_tokens > 0)
    host_tokens = cache.get("host_cached_tokens") or 0
    per_token = cache.get("host_loaded_bytes", 0) / host_tokens if host_tokens else 0.0
    sec["per_round"]["bytes_loaded"] = [
        sum(t.result.host_cached_tokens for t in turns if t.round == r) * per_token
        for r in range(rounds)
    ]


# the server's histograms (/metrics) a TTFT splits into: the server's own TTFT (from the
# tokenizer manager), the tokenizer's send -> the scheduler's read (inbox), arrival at the
# scheduler -> first step, first step -> first token, the first token's way back to the
# tokenizer manager (transit); and the steps' pipeline, worker and worker launch times and the
# time a finished result waited behind the next launch (held)
SERVER_TIMES = ("time_to_first_token_seconds", "inbox_time_seconds", "queue_time_seconds",
                "prefill_time_seconds", "first_token_transit_seconds", "step_time_seconds",
                "forward_time_seconds", "launch_time_seconds",
                "result_held_time_seconds")  # fmt: skip


def scheduler_times(url: str, api_key) -> dict[str, tuple[float, float]] | None:
    """(sum, count) of each of SERVER_TIMES from the server's /metrics; None without it
    (--disable-metrics, or a router)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(url + "/metrics", headers=common._headers(api_key), timeout=60)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    out = {}
    for family in text_string_to_metric_families(r.text):
        name = family.name.removeprefix("radix_runtime:")
        if name not in SERVER_TIMES:
            continue
        total = {s.name.rsplit("_", 1)[-1]: s.value for s in family.samples
                 if s.name.endswith(("_sum", "_count"))}  # fmt: skip
        out[name] = (total.get("sum", 0.0), total.get("count", 0.0))
    return out


def times_delta(before: dict | None, after: dict | None) -> dict | None:
    """The run's mean of each server time (seconds) and its count, from two scrapes."""
    if not before or not after:
        return None
    out = {}
    for name, (s1, c1) in after.items():
        s0, c0 = before.get(name, (0.0, 0.0))
        n = c1 - c0
        key = name.removesuffix("_seconds")
        out[f"{key}_mean_s"] = (s1 - s0) / n if n else None
        out[f"{key}_count"] = n
    return out


# the server's TTFT and the parts of it measured on their own (times_delta's key prefixes)
TTFT_PARTS = ("time_to_first_token", "inbox_time", "queue_time", "prefill_time",
              "first_token_transit")  # fmt: skip


def ttft_rest(times: dict) -> float | None:
    """The server's mean TTFT minus its measured parts (inbox, queue, prefill, transit): the
    time between them (the scheduler's first token sampled -> sent, the event loops' hops)."""
    values = [times.get(f"{k}_mean_s") for k in TTFT_PARTS]
    if any(v is None for v in values):
        return None
    return values[0] - sum(values[1:])


def measure_pinned_bandwidth() -> float | None:
    """Host-to-device copy bandwidth from pinned memory on this machine's GPU (bytes/s), the
    ceiling of a load; None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from radix_runtime.worker.host_pool import measure_load_bandwidth

    return measure_load_bandwidth(torch.device("cuda"), 1 << 30)


def tier_ratios(sections: dict, opts: argparse.Namespace) -> dict:
    """The host tier's goals: hit rate against the optimum, TTFT and throughput against the
    unrestricted pool, load throughput against the pinned copy bandwidth."""
    out: dict = {}
    ref = sections.get("unrestricted")
    pinned = measure_pinned_bandwidth() if opts.hicache_policies else None
    out["pinned_h2d_bandwidth"] = pinned
    for label, sec in sections.items():
        if label in ("cache_off",):
            continue
        cache = sec.get("server_cache") or {}
        row = {
            "hit_rate_over_optimal": common.ratio(sec["hit_rate"], sec["optimal_hit_rate"]),
            "host_hit_rate": common.hit_rate(
                cache.get("host_cached_tokens", 0), sec["prompt_tokens"]
            ),
            "bytes_loaded": cache.get("host_loaded_bytes"),
            "bytes_written": cache.get("host_written_bytes"),
            "load_s": cache.get("host_load_s"),
            "copy_wait_s": cache.get("host_copy_wait_s"),
        }
        if ref is not None:
            row["ttft_p50_over_unrestricted"] = common.ratio(sec["ttft_p50_s"], ref["ttft_p50_s"])
            row["output_tok_s_over_unrestricted"] = common.ratio(
                sec["output_tok_s"], ref["output_tok_s"]
            )
        if cache.get("host_load_s"):
            throughput = cache["host_loaded_bytes"] / cache["host_load_s"]
            row["load_throughput"] = throughput
            ceiling = pinned or cache.get("host_load_bandwidth")
            row["load_throughput_over_copy_bandwidth"] = common.ratio(throughput, ceiling)
        for kind, moved in (("load", "host_loaded_bytes"), ("write", "host_written_bytes")):
            if cache.get(f"host_{kind}_runs"):  # the worker's mean copy: one per run of pages
                row[f"{kind}_bytes_per_run"] = cache[moved] / cache[f"host_{kind}_runs"]
        out[label] = row
    return out


def check_fits(longest: int, info: dict) -> None:
    limit = info.get("context_length")
    if limit and longest > limit:
        raise SystemExit(
            f"the last round needs {longest} tokens (prompt + answer), more than the server's "
            f"context length {limit}: use fewer rounds or shorter turns"
        )


# ---------------------------------------------------------------------------------------------
# reporting


def print_table(result: dict) -> None:
    on, off = result["cache_on"], result["cache_off"]
    if on is None:  # --skip-device-only
        return
    sections = {"cache on": on} | ({"cache off": off} if off else {})
    print_metrics(sections, METRICS, width=12, ratio_head="off / on" if off else None)
    ratios = result["ratios"]
    print()
    print(f"TTFT p50 off/on:          {common.fmt(ratios['ttft_p50_off_over_on'], 1, 2)}")
    print(f"output tok/s on/off:      {common.fmt(ratios['output_tok_s_on_over_off'], 1, 2)}")
    print(f"hit rate / optimal:       {common.fmt(ratios['hit_rate_over_optimal'], 1, 3)}")
    print()
    print("per round (cache on):  round  prompt  TTFT p50  hit rate  optimal")
    pr = on["per_round"]
    for r in range(len(pr["hit_rate"])):
        print(
            f"{'':<23}{r:>5}  {common.fmt(pr['prompt_tokens_mean'][r], 1, 0):>6}"
            f"  {common.fmt(pr['ttft_p50_s'][r], 1, 3):>8}  {common.fmt(pr['hit_rate'][r]):>8}"
            f"  {common.fmt(pr['optimal_hit_rate'][r]):>7}"
        )


def print_tiers(result: dict) -> None:
    """The runs side by side (device-only, host tier per policy, unrestricted, off)."""
    tiers = result.get("tiers") or {}
    labels = [k for k in tiers if k != "pinned_h2d_bandwidth"]
    if len(labels) < 2:
        return
    print()
    print(f"{'run':<26}{'hit':>7}{'hit/opt':>9}{'host hit':>9}{'TTFT p50':>10}{'tok/s':>9}"
          f"{'TTFT/unr':>10}{'tok/s/unr':>10}{'MB loaded':>11}{'MB written':>11}{'load/bw':>9}")  # fmt: skip
    for label in labels:
        sec, row = result[label], tiers[label]
        print(
            f"{label:<26}{common.fmt(sec['hit_rate']):>7}"
            f"{common.fmt(row['hit_rate_over_optimal']):>9}{common.fmt(row['host_hit_rate']):>9}"
            f"{common.fmt(sec['ttft_p50_s']):>10}{common.fmt(sec['output_tok_s'], 1, 1):>9}"
            f"{common.fmt(row.get('ttft_p50_over_unrestricted'), 1, 2):>10}"
            f"{common.fmt(row.get('output_tok_s_over_unrestricted'), 1, 2):>10}"
            f"{common.fmt(row['bytes_loaded'] and row['bytes_loaded'] / 1e6, 1, 1):>11}"
            f"{common.fmt(row['bytes_written'] and row['bytes_written'] / 1e6, 1, 1):>11}"
            f"{common.fmt(row.get('load_throughput_over_copy_bandwidth'), 1, 2):>9}"
        )
    print("per-round hit rate:")
    for label in labels:
        rates = " ".join(common.fmt(x) for x in result[label]["per_round"]["hit_rate"])
        print(f"  {label:<24}{rates}")
    print("where a TTFT goes (means, ms; server: from the tokenizer manager; inbox: its send "
          "-> the scheduler's read; queue: at the scheduler until admitted; prefill: admitted "
          "-> first token; transit: the first token's send -> the tokenizer manager; rest: "
          "server minus those four; per step: step, forward, the worker's launch, a result held "
          "behind the next launch; copy wait: the steps' wait for the host tier's copies, per "
          "request loaded from the host):")  # fmt: skip
    print(f"  {'run':<24}{'client':>8}{'server':>8}{'inbox':>8}{'queue':>8}{'prefill':>8}"
          f"{'transit':>8}{'rest':>8}{'step':>8}{'forward':>8}{'launch':>8}{'held':>8}"
          f"{'copy wait':>10}")  # fmt: skip
    for label in labels:
        sec, times = result[label], result[label].get("scheduler") or {}
        wait = (sec.get("server_cache") or {}).get("host_copy_wait_s")
        loaded = sec.get("host_loaded_requests")
        per = wait / loaded if wait and loaded else None
        print(
            f"  {label:<24}{common.fmt(sec.get('ttft_mean_s'), 1e3, 1):>8}"
            + "".join(f"{common.fmt(times.get(f'{k}_mean_s'), 1e3, 1):>8}" for k in TTFT_PARTS)
            + f"{common.fmt(ttft_rest(times), 1e3, 1):>8}"
            + "".join(
                f"{common.fmt(times.get(f'{k}_mean_s'), 1e3, 1):>8}"
                for k in ("step_time", "forward_time", "launch_time", "result_held_time")
            )  # fmt: skip
            + f"{common.fmt(per, 1e3, 1):>10}"
        )
    tiered = [label for label in labels if (result[label].get("server_cache") or {}).get(
        "host_load_steps")]  # fmt: skip
    if tiered:
        print("the host tier's copies (steps with loads / writes, how many waited for the steps "
              "still running, the worker's host ms to queue a step's copies):")  # fmt: skip
        for label in tiered:
            c = result[label]["server_cache"]
            steps = c["host_load_steps"] + c.get("host_write_steps", 0)
            issue = c.get("host_copy_issue_s", 0.0) / steps if steps else None
            print(
                f"  {label:<24}loads {c['host_load_steps']} ({c.get('host_load_steps_waited', 0)}"
                f" waited)  writes {c.get('host_write_steps', 0)} "
                f"({c.get('host_write_steps_waited', 0)} waited)  issue "
                f"{common.fmt(issue, 1e3, 2)} ms  prefetched {c.get('host_prefetches', 0)} "
                f"(dropped {c.get('host_prefetches_dropped', 0)}, "
                f"{c.get('host_early_copies', 0)} sent while a step ran)"
            )


def plot(result: dict, path: str) -> None:
    plt = common.pyplot()
    on, off = result["cache_on"], result["cache_off"]
    cfg = result["config"]
    rounds = list(range(len(on["per_round"]["hit_rate"])))
    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(11, 4.2))

    def nan(values: list) -> list:
        return [math.nan if v is None else v for v in values]

    for label, sec, color in (("cache on", on, "tab:blue"), ("cache off", off, "tab:red")):
        if sec is None:
            continue
        ax_t.plot(
            rounds, nan(sec["per_round"]["ttft_p50_s"]), "o-", color=color, label=f"{label} p50"
        )
        ax_t.plot(
            rounds,
            nan(sec["per_round"]["ttft_p90_s"]),
            "--",
            color=color,
            alpha=0.6,
            label=f"{label} p90",
        )
    ax_t.set_xlabel("round")
    ax_t.set_ylabel("TTFT (s)")
    ax_t.set_title("time to first token by round")
    ax_t.set_xticks(rounds)
    ax_t.set_ylim(bottom=0)
    ax_t.grid(alpha=0.3)
    ax_t.legend()

    ax_h.plot(
        rounds,
        nan(on["per_round"]["optimal_hit_rate"]),
        "s--",
        color="gray",
        label="optimal (infinite cache)",
    )
    ax_h.plot(rounds, nan(on["per_round"]["hit_rate"]), "o-", color="tab:blue", label="cache on")
    if off is not None:
        ax_h.plot(
            rounds, nan(off["per_round"]["hit_rate"]), "o-", color="tab:red", label="cache off"
        )
    ax_h.set_xlabel("round")
    ax_h.set_ylabel("cached prompt tokens / prompt tokens")
    ax_h.set_title("cache hit rate by round")
    ax_h.set_xticks(rounds)
    ax_h.set_ylim(-0.02, 1.02)
    ax_h.grid(alpha=0.3)
    ax_h.legend(loc="lower right")

    fig.suptitle(
        f"{cfg.get('served_model_name')}: {cfg['clients']} clients x {cfg['rounds']} rounds, "
        f"system {cfg['system_tokens']}, context {cfg['context_tokens']}, "
        f"user {cfg['user_tokens']}, answer {cfg['answer_tokens']} tokens, "
        f"{cfg['max_inflight']} in flight",
        fontsize=10,
    )
    common.save_figure(fig, path)


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = common.server_bench_parser(__doc__)
    w = p.add_argument_group("workload")
    w.add_argument("--clients", type=int, default=8)
    w.add_argument("--rounds", type=int, default=4)
    w.add_argument("--system-tokens", type=int, default=256, help="shared by all clients")
    w.add_argument("--context-tokens", type=int, default=128, help="per client, first turn")
    w.add_argument("--user-tokens", type=int, default=32, help="per user turn")
    w.add_argument("--answer-tokens", type=int, default=32, help="per answer (EOS ignored)")
    w.add_argument("--max-inflight", type=int, default=None, help="default: --clients")
    w.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second; inf: closed loop",
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--text", action="store_true", help="send chat text instead of token ids")
    d = p.add_argument_group("data parallel (launched servers)")
    d.add_argument("--dp", type=int, default=0, help="replicas per launched server (serve --dp)")
    d.add_argument(
        "--router-policies",
        default=None,
        help="compare the router's policies, e.g. cache_aware,round_robin: one launched "
        "`serve --dp N --router-policy P` each (needs --dp >= 2)",
    )
    h = p.add_argument_group("host KV tier (docs/hicache.md)")
    h.add_argument(
        "--hicache-policies",
        default="",
        help="comma-separated write policies: one run each with --enable-hierarchical-cache",
    )
    h.add_argument("--hicache-args", default="", help="more flags for the host-tier runs")
    h.add_argument(
        "--compare-prefetch-off",
        action="store_true",
        help="one more host-tier run per policy with --hicache-prefetch off "
        "(hicache_POLICY_no_prefetch)",
    )
    h.add_argument(
        "--unrestricted-tokens",
        type=int,
        default=0,
        help="also run with --max-total-tokens N (the reference of the host-tier goals)",
    )
    p.add_argument(
        "--skip-device-only",
        action="store_true",
        help="with --hicache-policies or --unrestricted-tokens, leave out the device-only run "
        "(cache_on): only the tiered runs and the unrestricted pool (and cache off if asked)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", help="write the results as JSON here")
    o.add_argument("--plot", help="write a PNG plot here")
    return p


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    common.exit_on_sigterm()
    if opts.max_inflight is None:
        opts.max_inflight = opts.clients
    if min(opts.clients, opts.rounds, opts.max_inflight, opts.user_tokens, opts.answer_tokens) < 1:
        raise SystemExit(
            "--clients, --rounds, --max-inflight, --user-tokens, --answer-tokens must be >= 1"
        )
    if opts.router_policies:
        if opts.dp < 2:
            raise SystemExit("--router-policies needs --dp >= 2")
        result = run_router_policies(opts)
        print_policy_table(result)
        if opts.out:
            common.write_json(opts.out, result)
        return common.exit_code(list(result["policies"].values()))
    result = run(opts)
    print_table(result)
    print_tiers(result)
    if opts.out:
        common.write_json(opts.out, result)
    if opts.plot and result["cache_on"] is not None:
        plot(result, opts.plot)
    sections = [s for s in (result["cache_on"], result["cache_off"]) if s]
    sections += [result[k] for k in result.get("tiers", {}) if k in result and k != "cache_on"]
    return common.exit_code(sections)


if __name__ == "__main__":
    sys.exit(main())
