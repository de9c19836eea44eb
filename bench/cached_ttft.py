"""Cached-prefix TTFT through the server: HTTP request to the first streamed token.

The in-process figure (`bench/gpu_worker.py`'s `cached_ttft_speedup`) times two forwards of the
model runner. This one times what a client sees: for each of `--repeats` random prompts of
`--prompt-tokens` tokens, a cold request (nothing of it cached), then a request with the same
prompt but its last `--new-tokens` tokens replaced, so all but those are cached (page-aligned).
Both are streamed `/generate` calls with one output token, sent one at a time; TTFT is measured
as every benchmark here does (bench/common.py). The speedup is the median cold TTFT over the
median cached TTFT, both measured in the same run against the same server.

    python bench/cached_ttft.py --model llama-3.1-8b --server-args "--load-format dummy" \\
        --out docs/results/h200_cached_ttft.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common


async def measure(url: str, opts: argparse.Namespace, token_range: tuple[int, int]) -> list[dict]:
    """One {cold, cached} pair of requests per repeat, in order."""
    rng = np.random.default_rng(opts.seed)
    lo, hi = token_range
    pairs = []
    async with common.make_client(opts.api_key, 1) as client:
        t0 = time.perf_counter()
        for _ in range(opts.repeats):
            prompt = [int(x) for x in rng.integers(lo, hi, opts.prompt_tokens)]
            tail = [int(x) for x in rng.integers(lo, hi, opts.new_tokens)]
            hit = prompt[: opts.prompt_tokens - opts.new_tokens] + tail
            pair = {}
            for label, ids in (("cold", prompt), ("cached", hit)):
                r = await common.stream_generate(client, url, ids, 1, t0)
                if r.error is not None:
                    raise SystemExit(f"the {label} request failed: {r.error}")
                pair[f"{label}_ttft_s"] = r.ttft_s
                pair[f"{label}_cached_tokens"] = r.cached_tokens
            pairs.append(pair)
    return pairs


def run(opts: argparse.Namespace) -> dict:
    config = {k: v for k, v in vars(opts).items() if k not in ("api_key", "out")}
    config["host"] = common.host_info()
    (target,) = common.targets_from_args(opts)
    with common.open_target(target, opts) as url:
        info = common.prepare_server(url, opts.api_key)
        config["server"] = common.server_config(info, target.url, target.flags)
        config["served_model_name"] = info.get("served_model_name")
        if opts.prompt_tokens + 1 > (info.get("context_length") or opts.prompt_tokens + 1):
            raise SystemExit("--prompt-tokens exceeds the server's context length")
        pairs = common.run_async(measure(url, opts, common.safe_token_range(info["vocab_size"])))
    cold = statistics.median(p["cold_ttft_s"] for p in pairs)
    cached = statistics.median(p["cached_ttft_s"] for p in pairs)
    return {
        "provenance": common.provenance(
            "the cold TTFT of the same prompts against the same server, in the same run",
            common.targets_flags([target]),
        ),
        "config": config,
        "pairs": pairs,
        "cold_ttft_ms": cold * 1e3,
        "cached_ttft_ms": cached * 1e3,
        "cached_tokens": statistics.median(p["cached_cached_tokens"] for p in pairs),
        "cached_ttft_speedup": cold / cached,
    }


def main(argv: list[str] | None = None) -> int:
    p = common.server_bench_parser(__doc__)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument(
        "--new-tokens", type=int, default=256, help="uncached tokens of a cached request"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    opts = p.parse_args(argv)
    if opts.compare_no_cache:
        raise SystemExit("--compare-no-cache does not apply: the cold request is the reference")
    if not 1 <= opts.new_tokens < opts.prompt_tokens or opts.repeats < 1:
        raise SystemExit("need 1 <= --new-tokens < --prompt-tokens and --repeats >= 1")
    common.exit_on_sigterm()
    result = run(opts)
    print(
        f"cold TTFT {result['cold_ttft_ms']:.1f} ms, cached TTFT {result['cached_ttft_ms']:.1f} ms "
        f"({result['cached_tokens']:.0f} of {opts.prompt_tokens} tokens cached): speedup "
        f"{result['cached_ttft_speedup']:.2f} (median of {opts.repeats})"
    )
    if opts.out:
        common.write_json(opts.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
