"""Our CPU server next to llama.cpp's server on the same GGUF file, same thread count, same run.

    python bench/cpu_decode.py [--formats float32,bfloat16,int8,int4] [--threads 2] [--rounds 2]
                               [--tokens 64] [--out docs/results/cpu_vs_llamacpp.json]

The peer is llama-cpp-python's OpenAI server (`pip install 'radix_runtime[bench]'`) on the
embedded default GGUF (SmolLM2-135M-Instruct, Q4_1). Ours is `radix-runtime serve` once per
`--cpu-weight-format` (an entry of `--formats` may add our flags after a colon, e.g.
`int4:--cpu-small-step-threads=0`; the row is named by the whole entry). Both get `--threads`
(ours through OMP_NUM_THREADS), and both are measured over HTTP with `/v1/completions`, greedy,
EOS suppressed by logit_bias, engines alternating round by round so a busy machine hits both
alike (each number is the median of the rounds; the spread is kept in the JSON). Per engine:

- decode tok/s at batch 1 and 8: streamed completions of `--tokens` tokens; batch 1 counts from
  the first token to the last, batch 8 is the aggregate over the wall time of 8 concurrent ones;
- prefill tok/s: a fresh ~1K-token prompt, 1 token out: prompt tokens / time to the reply;
- cached-turn TTFT: the same 1K prompt plus the first turn's answer and a new user line, right
  after the first turn: time to the first streamed token (llama.cpp reuses its previous prompt's
  KV, we reuse the radix tree's).

Where our cached turn's time goes (`cached_turn_parts_ms`, per round): one more such turn, with
our /metrics read just before and after it (outside the timed turn above, whose client sees
nothing of it), split into the server's TTFT (tokenized request -> first token in the HTTP
process) and its measured parts (inbox, queue, prefill = the chunk's step, transit), and the
front: the client's TTFT minus the server's (HTTP, JSON, tokenization, SSE, the client itself).
llama.cpp's server has no such metrics: its rows carry none.

Goals (issue 23): batch-1 decode >= 1.0x llama.cpp, batch-8 aggregate >= 2x, cached TTFT <= 0.5x.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import LaunchedServer, _die_with_parent, exit_on_sigterm, free_port, provenance
from bench.multi_turn_chat import TTFT_PARTS, scheduler_times, times_delta
from radix_runtime.model_source import default_gguf_path

EOS_BIAS = {"0": -100.0, "2": -100.0}  # <|endoftext|>, <|im_end|>: a fixed number of tokens
DECODE_PROMPT = "Write a long story about a lighthouse keeper and the sea. Once upon a time,"
FILLER = (
    "The committee reviewed the annual report on coastal infrastructure, noting that repairs to "
    "the northern breakwater, the harbour lights and the ferry terminal were completed on time. "
)


def long_prompt(tag: str, repeats: int = 28) -> str:
    """About 1K tokens of text; `tag` first makes it new to both engines' caches."""
    return f"[{tag}] " + FILLER * repeats + "\nQuestion: summarise the report in one sentence."


class LlamaCppServer:
    """`python -m llama_cpp.server` on a free port, stopped on exit."""

    def __init__(self, model: str, threads: int, ctx: int = 4096) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "llama_cpp.server", "--model", model, "--port", str(self.port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(ctx),
            # its default cuts a running stream when the next request arrives: queue them instead
            "--interrupt_requests", "False",
        ]  # fmt: skip
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="llamacpp-"), "server.log")

    def __enter__(self) -> LlamaCppServer:
        print(f"launching: {shlex.join(self.cmd)}  (log: {self.log_path})", file=sys.stderr)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log_path) as f:
                    raise RuntimeError(f"llama.cpp's server exited:\n{f.read()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return self
            time.sleep(0.3)
        raise RuntimeError("llama.cpp's server did not come up in 300 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_CLIENT: httpx.Client | None = None


def client() -> httpx.Client:
    """One HTTP client for every request of the run (thread-safe; keeps its connections).
    NOTE: a new `httpx.Client` per request (what `httpx.stream`/`httpx.post` make) costs
    50-100 ms on a loaded 2-core machine (its TLS context), inside the timed window."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=16))
    return _CLIENT


def stream(url: str, prompt: str, max_tokens: int) -> tuple[float, float, float, int, str]:
    """(t_sent, t_first_token, t_last_token, events, text) of one streamed greedy completion."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "logit_bias": EOS_BIAS,
    }
    t0 = time.perf_counter()
    first = last = None
    events, text = 0, []
    with client().stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text") or ""
            if not piece:
                continue
            now = time.perf_counter()
            first = first if first is not None else now
            last, events = now, events + 1
            text.append(piece)
    return t0, first or t0, last or t0, events, "".join(text)


def complete(url: str, prompt: str, max_tokens: int) -> tuple[float, dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    t0 = time.perf_counter()
    r = client().post(url + "/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


def measure(url: str, tokens: int, tag: str) -> dict:
    """One round of the four measurements against one server."""
    stream(url, DECODE_PROMPT, 4)  # warm-up
    _, first, last, _, _ = stream(url, DECODE_PROMPT, tokens)
    decode_b1 = (tokens - 1) / (last - first)

    results: list = [None] * 8

    def one(i: int) -> None:
        try:
            results[i] = stream(url, f"{i}. {DECODE_PROMPT}", tokens)
        except Exception as exc:  # raised in the main thread below
            results[i] = exc

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    decode_b8 = 8 * tokens / (time.perf_counter() - t0)
    for r in results:
        if isinstance(r, Exception):
            raise RuntimeError(f"a batch-8 stream failed: {r}") from r
        if r[3] == 0:
            raise RuntimeError("a batch-8 stream returned no text")

    prompt = long_prompt(f"prefill {tag}")
    seconds, reply = complete(url, prompt, 1)
    prefill = reply["usage"]["prompt_tokens"] / seconds

    sent, first, _, _, _ = stream(url, second_turn(url, f"chat {tag}"), 2)
    parts = cached_turn_parts(url, f"parts {tag}")
    return {
        "loadavg_1m": os.getloadavg()[0],  # the machine's load right after the round
        "decode_b1_tok_s": decode_b1,
        "decode_b8_tok_s": decode_b8,
        "prefill_tok_s": prefill,
        "prefill_prompt_tokens": reply["usage"]["prompt_tokens"],
        "cached_turn_ttft_s": first - sent,
        **({"cached_turn_parts_ms": parts} if parts is not None else {}),
    }


def second_turn(url: str, tag: str) -> str:
    """A chat's second turn: a long first turn sent and answered (24 tokens), then the history
    with its answer and a short question; its prefix is the server's to reuse."""
    history = long_prompt(tag)
    _, answer = complete(url, history, 24)
    return history + answer["choices"][0]["text"] + "\nQuestion: and in one word?"


def cached_turn_parts(url: str, tag: str) -> dict[str, float] | None:
    """A cached turn as `measure` times it, split by the server's /metrics (read before and
    after it): ms of the client's TTFT, the server's TTFT, its TTFT_PARTS and the front (client
    minus server); None without /metrics (llama.cpp's server)."""
    if scheduler_times(url, None) is None:  # no /metrics of ours: no turn to spend
        return None
    turn2 = second_turn(url, f"chat {tag}")
    before = scheduler_times(url, None)
    sent, first, _, _, _ = stream(url, turn2, 2)
    return ttft_parts(first - sent, times_delta(before, scheduler_times(url, None)))


def ttft_parts(client_ttft_s: float, times: dict | None) -> dict[str, float] | None:
    """ms of one request's TTFT: the client's, the server's and its parts (`times_delta` over
    that request alone), and the front: the client's minus the server's."""
    if not times or times.get("time_to_first_token_mean_s") is None:
        return None
    out = {"client_ttft": client_ttft_s * 1e3}
    for key in TTFT_PARTS:
        value = times.get(f"{key}_mean_s")
        if value is not None:
            out[key] = value * 1e3
    out["front"] = out["client_ttft"] - out["time_to_first_token"]
    return out


METRICS = ("decode_b1_tok_s", "decode_b8_tok_s", "prefill_tok_s", "cached_turn_ttft_s")


def summarize(rounds: list[dict]) -> dict:
    out = {}
    for k in METRICS:
        values = [r[k] for r in rounds]
        out[k] = statistics.median(values)
        out[k + "_spread"] = [min(values), max(values)]
    return out


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def commit() -> str | None:
    with contextlib.suppress(Exception):
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    return None


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--formats", default="float32,bfloat16,int8,int4")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    exit_on_sigterm()  # launched servers are stopped on the way out
    formats = args.formats.split(",")
    gguf = default_gguf_path()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # our worker's threads (cpu_threads())
    flags = ["--max-total-tokens", "16384", "--device", "cpu"]
    ours: dict[str, list[dict]] = {f: [] for f in formats}
    peer: list[dict] = []
    with LlamaCppServer(gguf, args.threads) as llama:
        for fmt in formats:
            name, _, extra = fmt.partition(":")
            fmt_flags = [*flags, "--cpu-weight-format", name, *shlex.split(extra)]
            with LaunchedServer("default", fmt_flags) as server:
                for r in range(args.rounds):  # alternate the engines
                    ours[fmt].append(measure(server.url, args.tokens, f"{fmt} {r}"))
                    peer.append(measure(llama.url, args.tokens, f"llama {fmt} {r}"))
                    print(f"{fmt} round {r}: ours {ours[fmt][-1]}\n  llama.cpp {peer[-1]}")
    ref = summarize(peer)
    rows = []
    for fmt in formats:
        s = summarize(ours[fmt])
        rows.append(
            {
                "format": fmt,
                **s,
                "decode_b1_vs_llama": s["decode_b1_tok_s"] / ref["decode_b1_tok_s"],
                "decode_b8_vs_llama": s["decode_b8_tok_s"] / ref["decode_b8_tok_s"],
                "prefill_vs_llama": s["prefill_tok_s"] / ref["prefill_tok_s"],
                "cached_ttft_vs_llama": s["cached_turn_ttft_s"] / ref["cached_turn_ttft_s"],
                "rounds": ours[fmt],
            }
        )
    print(f"\nSmolLM2-135M-Instruct Q4_1 on {cpu_model()}, {args.threads} threads, medians")
    head = (
        f"{'engine':>16} {'b1 tok/s':>9} {'b8 tok/s':>9} {'prefill tok/s':>14} {'cached TTFT':>12}"
    )
    print(head)
    print(
        f"{'llama.cpp':>16} {ref['decode_b1_tok_s']:>9.1f} {ref['decode_b8_tok_s']:>9.1f} "
        f"{ref['prefill_tok_s']:>14.0f} {ref['cached_turn_ttft_s'] * 1e3:>10.0f}ms"
    )
    for r in rows:
        parts = [x["cached_turn_parts_ms"] for x in r["rounds"] if "cached_turn_parts_ms" in x]
        r["cached_turn_parts_ms"] = {
            k: statistics.median(p[k] for p in parts) for k in parts[0] if all(k in p for p in parts)
        } if parts else None  # fmt: skip
    for r in rows:
        print(
            f"{'ours ' + r['format']:>16} {r['decode_b1_tok_s']:>9.1f} {r['decode_b8_tok_s']:>9.1f} "
            f"{r['prefill_tok_s']:>14.0f} {r['cached_turn_ttft_s'] * 1e3:>10.0f}ms   "
            f"x llama.cpp: b1 {r['decode_b1_vs_llama']:.2f} b8 {r['decode_b8_vs_llama']:.2f} "
            f"prefill {r['prefill_vs_llama']:.2f} cached TTFT {r['cached_ttft_vs_llama']:.2f}"
        )
    print("our cached turn's TTFT by part (ms, median of the rounds; front = client - server):")
    for r in rows:
        if r["cached_turn_parts_ms"]:
            split = "  ".join(f"{k} {v:.1f}" for k, v in r["cached_turn_parts_ms"].items())
            print(f"{'ours ' + r['format']:>16} {split}")
    if args.out:
        import llama_cpp

        result = {
            "provenance": provenance(
                "llama.cpp's server (llama-cpp-python) on the same GGUF and threads, same run",
                server_flags={
                    "ours": shlex.join(flags) + " --cpu-weight-format FORMAT",
                    "llama.cpp": f"--n_threads {args.threads} --n_threads_batch {args.threads} "
                    "--n_ctx 4096",
                },
            ),
            "commit": commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cpu_model": cpu_model(),
            "cpus": os.cpu_count(),
            "loadavg_1m_at_end": os.getloadavg()[0],
            "command": shlex.join([sys.executable, *sys.argv]),
            "threads": args.threads,
            "tokens": args.tokens,
            "server_flags": flags,
            "gguf": os.path.basename(gguf),
            "reference": {
                "engine": f"llama-cpp-python {llama_cpp.__version__} server",
                **ref,
                "rounds": peer,
            },
            "goals": {
                "decode_b1_vs_llama": ">= 1.0",
                "decode_b8_vs_llama": ">= 2.0",
                "cached_ttft_vs_llama": "<= 0.5",
            },  # fmt: skip
            "rows": rows,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
