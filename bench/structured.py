"""Constrained decoding: its cost next to unconstrained decoding on the same prompts, grammar
compile times and the compile cache, and what jump-forward decoding saves.

    python bench/structured.py [--url URL | --model M --server-args "..."] [--batch 1,8]
        [--tokens 64] [--schemas 40] [--out docs/results/cpu_structured.json]

One run, three parts (every ratio divides by a reference measured in the same run):

1. Throughput, per batch size B: B concurrent /generate requests (random token prompts, greedy,
   EOS ignored, exactly --tokens outputs each) unconstrained, then the same prompts constrained
   by a JSON schema that cannot end before --tokens tokens (an array of at least 1,000 integers:
   the mask is never trivial). Output tok/s of each and the ratio constrained / unconstrained.
2. Compile: --schemas distinct JSON schemas (objects with varied property names and types), each
   sent twice in a shuffled trace (one output token each): compile time p50 / p99 / max and the
   cache hit rate from the server's /get_server_info (`grammar`).
3. Jump-forward: a schema with long fixed keys, one request at a time, against a server without
   and a server with --enable-jump-forward (launched here; with --url, give --url-jump-forward):
   output tokens per forward step (server `steps`), tokens appended by jump-forward, mean
   latency and latency per output token, and their ratios with / without (the outputs are not
   the same tokens: a forced string is tokenized on its own).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    LaunchedServer,
    get_server_info,
    provenance,
    ratio,
    safe_token_range,
    warm_up,
    write_json,
)

# cannot end before ~2,000 tokens: every constrained output runs to --tokens
LONG_ARRAY = {"type": "array", "items": {"type": "integer"}, "minItems": 1000}
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 99999},
        "customer_full_legal_name": {"type": "string", "maxLength": 12},
        "customer_preferred_contact_method": {"enum": ["electronic_mail", "telephone_call"]},
        "customer_account_creation_year": {"type": "integer", "minimum": 1990, "maximum": 2030},
        "customer_is_subscribed_to_newsletter": {"type": "boolean"},
    },
    "required": [
        "customer_identification_number",
        "customer_full_legal_name",
        "customer_preferred_contact_method",
        "customer_account_creation_year",
        "customer_is_subscribed_to_newsletter",
    ],
}
TYPES = [
    {"type": "integer"},
    {"type": "string", "maxLength": 8},
    {"type": "boolean"},
    {"type": "number", "minimum": 0, "maximum": 10},
    {"enum": ["a", "b", "c"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
]


def varied_schemas(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "omega",
        "kappa",
        "sigma",
        "theta",
        "lambda",
        "zeta",
    ]
    out = []
    for i in range(n):
        props = {
            f"{rng.choice(words)}_{i}_{k}": rng.choice(TYPES) for k in range(rng.randint(2, 8))
        }
        if i % 3 == 0:  # some nesting
            props[f"nested_{i}"] = {"type": "object", "properties": dict(list(props.items())[:2])}
        out.append({"type": "object", "properties": props, "required": list(props)[:2]})
    return out


def prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    lo, hi = safe_token_range(vocab_size)
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


async def generate_all(url: str, bodies: list[dict]) -> tuple[float, list[dict]]:
    """Send every body at once; (wall seconds, replies)."""
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
        wall = time.perf_counter() - t0
    for r in replies:
        r.raise_for_status()
    return wall, [r.json() for r in replies]


def body(ids: list[int], tokens: int, schema: dict | None, ignore_eos: bool = True) -> dict:
    sp = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": ignore_eos}
    if schema is not None:
        sp["json_schema"] = schema
    return {"input_ids": ids, "sampling_params": sp}


def out_tokens(replies: list[dict]) -> list[int]:
    return [r["meta_info"]["completion_tokens"] for r in replies]


def throughput(url: str, batch: int, tokens: int, vocab: int, repeats: int) -> dict:
    """The two arms alternate `repeats` times (a shared machine drifts); the median of each."""
    ps = prompts(batch, 64, vocab, seed=batch)
    asyncio.run(generate_all(url, [body(ps[0], 4, LONG_ARRAY)]))  # compile outside the timing
    runs: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    for _ in range(repeats):
        for name, schema in (("unconstrained", None), ("constrained", LONG_ARRAY)):
            wall, replies = asyncio.run(generate_all(url, [body(p, tokens, schema) for p in ps]))
            n = out_tokens(replies)
            runs[name].append(
                {
                    "wall_s": wall,
                    "tok_s": sum(n) / wall,
                    "all_outputs_full_length": all(k == tokens for k in n),
                }
            )
    row: dict = {"batch": batch, "repeats": repeats}
    for name, rs in runs.items():
        rates = sorted(r["tok_s"] for r in rs)
        row[name] = {
            "tok_s": rates[len(rates) // 2],
            "tok_s_runs": [r["tok_s"] for r in rs],
            "all_outputs_full_length": all(r["all_outputs_full_length"] for r in rs),
        }
    row["ratio_tok_s"] = ratio(row["constrained"]["tok_s"], row["unconstrained"]["tok_s"])
    return row


def compile_stats(url: str, n: int, vocab: int) -> dict:
    schemas = varied_schemas(n)
    trace = schemas + schemas
    random.Random(1).shuffle(trace)
    before = get_server_info(url).get("grammar") or {}
    (p,) = prompts(1, 16, vocab, seed=7)
    t0 = time.perf_counter()
    # a few at a time, as clients would send them
    for i in range(0, len(trace), 8):
        asyncio.run(generate_all(url, [body(p, 1, s) for s in trace[i : i + 8]]))
    wall = time.perf_counter() - t0
    after = get_server_info(url)["grammar"]
    requests = after["requests"] - before.get("requests", 0)
    hits = after["cache_hits"] - before.get("cache_hits", 0)
    return {
        "distinct_schemas": n,
        "requests": requests,
        "compiles": after["compiles"] - before.get("compiles", 0),
        "cache_hit_rate": hits / requests if requests else None,
        "compile_p50_s": after["compile_p50_s"],
        "compile_p99_s": after["compile_p99_s"],
        "compile_max_s": after["compile_max_s"],
        "note": "compile times: the server's latest compiles (every distinct schema of this run)",
        "trace_wall_s": wall,
    }


def jump_forward_run(url: str, vocab: int, repeats: int, tokens: int) -> dict:
    ps = prompts(repeats, 32, vocab, seed=11)
    before = get_server_info(url)
    latencies, outs = [], []
    for p in ps:
        wall, (reply,) = asyncio.run(
            generate_all(url, [body(p, tokens, LONG_KEYS, ignore_eos=False)])
        )
        latencies.append(wall)
        outs.append(reply)
    after = get_server_info(url)
    steps = after["steps"] - before["steps"]
    n = sum(out_tokens(outs))
    return {
        "requests": repeats,
        "output_tokens": n,
        "forward_steps": steps,
        "tokens_per_step": n / steps if steps else None,
        "jumped_tokens": after.get("jumped_tokens", 0) - before.get("jumped_tokens", 0),
        "latency_mean_s": sum(latencies) / len(latencies),
        "latency_per_output_token_s": sum(latencies) / n if n else None,
        "finish_reasons": [r["meta_info"]["finish_reason"]["type"] for r in outs],
        "first_text": outs[0].get("text"),  # None without a tokenizer (dummy weights)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="a running server (jump-forward off)")
    ap.add_argument("--url-jump-forward", help="a running server with --enable-jump-forward")
    ap.add_argument("--model", default="default")
    ap.add_argument("--server-args", default="", help="flags for the launched servers")
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--schemas", type=int, default=40, help="distinct schemas (compile part)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per batch size")
    ap.add_argument("--jump-repeats", type=int, default=4)
    ap.add_argument("--jump-tokens", type=int, default=256, help="max output tokens (part 3)")
    ap.add_argument("--launch-timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    flags = shlex.split(args.server_args)
    result: dict = {}

    def open_server(extra: list[str], url: str | None):
        if url:
            return _Given(url)
        return LaunchedServer(args.model, [*flags, *extra], timeout=args.launch_timeout)

    with open_server([], args.url) as server:
        info = get_server_info(server.url)
        vocab = info["vocab_size"]
        warm_up(server.url, vocab)
        result["throughput"] = [
            throughput(server.url, b, args.tokens, vocab, args.repeats) for b in batches
        ]
        for row in result["throughput"]:
            print(
                f"batch {row['batch']:4d}: unconstrained {row['unconstrained']['tok_s']:9.1f} "
                f"tok/s, constrained {row['constrained']['tok_s']:9.1f} tok/s, "
                f"ratio {row['ratio_tok_s']:.3f}"
            )
        result["compile"] = compile_stats(server.url, args.schemas, vocab)
        c = result["compile"]
        print(
            f"compile: p50 {c['compile_p50_s'] * 1e3:.1f} ms, p99 {c['compile_p99_s'] * 1e3:.1f} "
            f"ms, max {c['compile_max_s'] * 1e3:.1f} ms; cache hit rate {c['cache_hit_rate']:.3f}"
        )
        off = jump_forward_run(server.url, vocab, args.jump_repeats, args.jump_tokens)
    with open_server(["--enable-jump-forward"], args.url_jump_forward) as server:
        warm_up(server.url, vocab)
        on = jump_forward_run(server.url, vocab, args.jump_repeats, args.jump_tokens)
    result["jump_forward"] = {
        "schema": LONG_KEYS,
        "off": off,
        "on": on,
        "latency_ratio_on_off": ratio(on["latency_mean_s"], off["latency_mean_s"]),
        # the outputs differ (a forced string is tokenized on its own, the model continues from
        # those tokens): per output token is the like-for-like latency
        "latency_per_token_ratio_on_off": ratio(
            on["latency_per_output_token_s"], off["latency_per_output_token_s"]
        ),
        "tokens_per_step_ratio_on_off": ratio(on["tokens_per_step"], off["tokens_per_step"]),
    }
    jf = result["jump_forward"]
    print(
        f"jump-forward: tokens/step {off['tokens_per_step']:.2f} -> {on['tokens_per_step']:.2f}, "
        f"jumped {on['jumped_tokens']} of {on['output_tokens']} tokens, latency ratio "
        f"{jf['latency_ratio_on_off']:.3f}, per output token {jf['latency_per_token_ratio_on_off']:.3f}"
    )
    result = {
        "provenance": provenance(
            "unconstrained decoding of the same prompts / jump-forward off, in the same run",
            server_flags={"launched": shlex.join(flags), "url": args.url},
        ),
        "config": {
            "model": args.model,
            "batches": batches,
            "tokens": args.tokens,
            "constrained_schema": LONG_ARRAY,
            "vocab_size": vocab,
        },
        **result,
    }
    if args.out:
        write_json(args.out, result)
    else:
        print(json.dumps(result, indent=1)[:2000])


class _Given:
    """A server given by URL (not launched or stopped here)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def __enter__(self) -> _Given:
        return self

    def __exit__(self, *exc) -> None:
        pass


if __name__ == "__main__":
    main()
