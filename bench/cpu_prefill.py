"""Our CPU server's prefill, one weight format against another, in the same run.

    OMP_NUM_THREADS=2 python bench/cpu_prefill.py [--formats float32,int4] [--threads 2]
                                                 [--rounds 5] [--out docs/results/...json]

One server per format (`--device cpu --cpu-weight-format FORMAT`), all started first; then each
round sends every server a fresh ~1K-token prompt (bench/cpu_decode.py's, new to the radix cache)
with 1 token out, the formats in turn, so a drift of the shared machine touches every format
alike. Reported: prompt tokens / time to the reply, median of the rounds, and each format over
the first one (the reference).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import LaunchedServer, exit_on_sigterm, provenance
from bench.cpu_decode import complete, long_prompt


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--formats", default="float32,int4")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    exit_on_sigterm()  # launched servers are stopped on the way out
    formats = args.formats.split(",")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # our worker's threads (cpu_threads())
    flags = ["--max-total-tokens", "16384", "--device", "cpu"]
    rounds: dict[str, list[float]] = {f: [] for f in formats}
    with ExitStack() as stack:
        servers = {
            f: stack.enter_context(LaunchedServer("default", [*flags, "--cpu-weight-format", f]))
            for f in formats
        }
        for f, server in servers.items():  # warm-up: the first prefill of a process
            complete(server.url, long_prompt(f"warm-up {f}"), 1)
        for r in range(args.rounds):
            for f, server in servers.items():
                seconds, reply = complete(server.url, long_prompt(f"prefill {f} {r}"), 1)
                rounds[f].append(reply["usage"]["prompt_tokens"] / seconds)
            print(f"round {r}: " + "  ".join(f"{f} {rounds[f][-1]:.0f}" for f in formats))
    ref = statistics.median(rounds[formats[0]])
    rows = []
    for f in formats:
        med = statistics.median(rounds[f])
        rows.append(
            {
                "format": f,
                "prefill_tok_s": med,
                "prefill_tok_s_spread": [min(rounds[f]), max(rounds[f])],
                f"vs_{formats[0]}": med / ref,
                "rounds": rounds[f],
            }
        )
        print(f"{f:>10} prefill {med:7.0f} tok/s (median of {args.rounds}), {med / ref:.3f}x")
    if args.out:
        result = {
            "provenance": provenance(
                f"the {formats[0]} server's prefill, same run, rounds alternated",
                server_flags=" ".join(flags) + " --cpu-weight-format FORMAT",
            ),
            "threads": args.threads,
            "prompt": "bench/cpu_decode.py long_prompt (~890 tokens), fresh each request",
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
