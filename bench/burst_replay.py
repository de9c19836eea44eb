"""A burst of prompts through the scheduler alone: the step schedule and the ITL it implies.

bench/serving.py's random burst (--num-prompts requests of --input-len prompt and --output-len
output tokens, all at once) replayed against the real `Scheduler` (admission, the overlap
schedule, --chunked-prefill-size, --max-consecutive-prefill-steps, --enable-mixed-chunk as the
server runs them) with a worker that computes nothing and samples every row at once. Each step
is given a modelled duration, so the replay yields each request's token times and from them the
ITL percentiles that the schedule alone would produce:

    step = FIXED + context tokens read x KV bytes per token / bandwidth x OVERHEAD
           + prefill tokens x PREFILL_S_PER_TOKEN (+ PREFILL_FIXED when it holds any)

The defaults are the H200 figures of docs/serving_roofline.md for the Llama-3.1-8B shape
(a 256-request decode step at ~1.5K context ~18 ms, a 1,000-token prefill step ~36 ms). What the
replay leaves out (the host's own pauses, the front, the client) is what a server's ITL beyond
the replay's is made of.

    python bench/burst_replay.py --num-prompts 512 --input-len 1000 --output-len 1000
    python bench/burst_replay.py ... --server-args "--max-consecutive-prefill-steps 1"
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common  # noqa: E402
from bench.admission_replay import fake_worker_ready, sampled_result  # noqa: E402
from radix_runtime import messages as m  # noqa: E402
from radix_runtime.config import parse_server_args  # noqa: E402
from radix_runtime.scheduler.main import advance  # noqa: E402
from radix_runtime.scheduler.scheduler import Scheduler  # noqa: E402

VOCAB = 128256


class StepModel:
    """A step's modelled seconds from what it holds."""

    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts

    def seconds(self, context_tokens: int, prefill_tokens: int) -> float:
        o = self.opts
        s = o.fixed_ms / 1e3
        s += context_tokens * o.kv_bytes_per_token / (o.bandwidth_TBps * 1e12) * o.overhead
        if prefill_tokens:
            s += o.prefill_fixed_ms / 1e3 + prefill_tokens * o.prefill_us_per_token / 1e6
        return s


def replay(opts: argparse.Namespace) -> dict:
    args = parse_server_args(["--max-total-tokens", str(opts.pool), *shlex.split(opts.server_args)])
    ps = args.page_size
    ready = fake_worker_ready(
        opts.pool // ps + 1,
        ps,
        VOCAB,
        max_running_requests=args.max_running_requests or opts.max_running,
    )
    sched = Scheduler(args, ready)
    rng = np.random.default_rng(opts.seed)
    sampling = m.SamplingParams(max_new_tokens=opts.output_len, temperature=0.0, ignore_eos=True)
    for i in range(opts.num_prompts):
        ids = rng.integers(1, VOCAB, opts.input_len).tolist()
        sched.add_request(m.GenerateReq(rid=f"r{i}", input_ids=m.pack_ids(ids), sampling=sampling))
    model = StepModel(opts)
    clock = 0.0
    steps: list[tuple[int, int, float]] = []  # (decode rows, prefill tokens, seconds)
    times: dict[str, list[float]] = {}

    def send(batch: m.ForwardBatch, plan) -> m.ForwardResult:
        nonlocal clock
        context = prefill = rows = 0
        for p in plan:
            if p.req.output_ids or p.start >= len(p.req.prompt):  # a decode row
                rows += 1
                context += p.start
            else:
                prefill += p.num_tokens
        dt = model.seconds(context, prefill)
        clock += dt
        steps.append((rows, prefill, dt))
        return sampled_result(batch, VOCAB, batch.step, forward_s=dt)

    finished, inflight = 0, None
    while finished < opts.num_prompts:
        inflight, _ = advance(sched, inflight, send, sched.process_result)
        for out in sched.take_outputs():
            if out.new_ids:
                times.setdefault(out.rid, []).extend([clock] * (len(out.new_ids) // 4))
            finished += out.finish_reason is not None
        if len(steps) > 50 * (opts.num_prompts * (opts.input_len + opts.output_len) + 1000):
            raise RuntimeError("no progress")
    itls = np.concatenate([np.diff(t) for t in times.values() if len(t) > 1])
    p50, p99 = float(np.percentile(itls, 50)), float(np.percentile(itls, 99))
    output_tokens = sum(len(t) for t in times.values())
    return {
        "steps": len(steps),
        "decode_steps": sum(1 for r, _, _ in steps if r),
        "prefill_steps": sum(1 for _, p, _ in steps if p),
        "mixed_steps": sum(1 for r, p, _ in steps if r and p),
        "mean_decode_batch": float(np.mean([r for r, _, _ in steps if r])) if steps else 0.0,
        "duration_s": clock,
        "output_tok_s": output_tokens / clock if clock else 0.0,
        "itl_p50_s": p50,
        "itl_p99_s": p99,
        "itl_p999_s": float(np.percentile(itls, 99.9)),
        "itl_max_s": float(itls.max()),
        "itl_p99_over_p50": p99 / p50 if p50 else None,
        "intervals": int(itls.size),
        "intervals_over_3x_p50": int((itls > 3 * p50).sum()),
        "retractions": sched.retractions,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--pool", type=int, default=829581, help="KV pool tokens (the H200 run's)")
    p.add_argument("--max-running", type=int, default=256, help="the worker's slots")
    p.add_argument("--server-args", default="", help="scheduler flags, as the server takes them")
    p.add_argument("--seed", type=int, default=0)
    m_ = p.add_argument_group("step model (defaults: the H200, Llama-3.1-8B shape)")
    m_.add_argument("--fixed-ms", type=float, default=4.0, help="per step: weights, launch")
    m_.add_argument("--kv-bytes-per-token", type=int, default=131072)
    m_.add_argument("--bandwidth-TBps", type=float, default=4.2)
    m_.add_argument("--overhead", type=float, default=1.15, help="attention vs the bandwidth")
    m_.add_argument("--prefill-fixed-ms", type=float, default=3.0)
    m_.add_argument("--prefill-us-per-token", type=float, default=30.0)
    p.add_argument("--out", help="write the result as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    result = replay(opts)
    for k, v in result.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    if opts.out:
        cfg = {k: v for k, v in vars(opts).items() if k != "out"}
        prov = common.provenance("the step model's parameters (config); no device", None)
        Path(opts.out).write_text(
            json.dumps({"provenance": prov, "config": cfg, "result": result}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
