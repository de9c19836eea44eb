"""A multi-turn trace through the scheduler alone: when is each turn admitted?

bench/multi_turn_chat.py's workload (clients, rounds, a shared system prompt, a first turn,
user turns and answers, a cap on the turns in flight) replayed against the real `Scheduler`
(the radix tree of --radix-tree-impl, the overlap schedule, admission as the server runs it)
with a worker that computes nothing and answers every sampled row at once. A turn's next round
is issued as soon as it finishes (closed loop, the longest-waiting client first, as the bench's
semaphore does). Time is counted in steps, so what is measured is the scheduling alone: how many
steps each turn waits from its arrival to its first token, how often admission refused a turn
for memory, and the smallest margin of pages admission had left when it admitted one.

    python bench/admission_replay.py --pool 22000 --hicache-ratio 6 \\
        --out docs/results/admission_replay_hicache.json

runs the host-tier pool and an unrestricted one (`--unrestricted-tokens`) on the same trace.
`--diverge` makes the answer a client sends back differ from the one generated in its second
half, as a replayed bench run does when the server's greedy answer differs from the replayed one.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from radix_runtime import messages as m  # noqa: E402
from radix_runtime.config import ServerArgs  # noqa: E402
from radix_runtime.scheduler.main import advance  # noqa: E402
from radix_runtime.scheduler.scheduler import Scheduler  # noqa: E402

VOCAB = 32000


class _Watch:
    """Wraps `KvBook.admit` of one scheduler: refusals and the page margin at each call."""

    def __init__(self, kv) -> None:
        self.refused = self.admitted = 0
        self.min_margin: int | None = None
        self.max_held = 0
        admit = kv.admit

        def watched(req, match, budget, reserve):
            margin = kv.available_pages() - reserve
            self.max_held = max(self.max_held, kv.allocator.total_pages - kv.available_pages())
            got = admit(req, match, budget, reserve)
            if got is None:
                self.refused += 1
            else:
                self.admitted += 1
                self.min_margin = (
                    margin if self.min_margin is None else min(self.min_margin, margin)
                )
            return got

        kv.admit = watched


def fake_worker_ready(num_pages: int, page_size: int, vocab: int, **kw) -> m.WorkerReady:
    """What a worker that computes nothing reports at start (the replays' scheduler input)."""
    return m.WorkerReady(
        num_pages=num_pages,
        page_size=page_size,
        context_length=131072,
        vocab_size=vocab,
        eos_token_ids=[0],
        device="cpu",
        dtype="none",
        attention_backend="none",
        **kw,
    )


def sampled_result(
    batch: m.ForwardBatch, vocab: int, offset: int, forward_s: float
) -> m.ForwardResult:
    """A step's result with a made-up token id (from `offset`) for every row that samples."""
    results = [
        m.ForwardReqResult(next_id=1 + (offset + i) % (vocab - 1))
        if r.sample
        else m.ForwardReqResult()
        for i, r in enumerate(batch.reqs)
    ]
    return m.ForwardResult(step=batch.step, results=results, forward_s=forward_s)


def replay(opts: argparse.Namespace, pool: int, hicache: bool) -> dict:
    args = ServerArgs(
        page_size=opts.page_size,
        max_total_tokens=pool,
        chunked_prefill_size=opts.chunk,
        radix_tree_impl=opts.radix_tree_impl,
        enable_hierarchical_cache=hicache,
        hicache_write_policy=opts.policy,
    )
    pages = pool // opts.page_size + 1
    ready = fake_worker_ready(
        pages,
        opts.page_size,
        VOCAB,
        max_running_requests=256,
        host_num_pages=int(opts.hicache_ratio * (pages - 1)) + 1 if hicache else 0,
        kv_bytes_per_token=131072,  # the Llama-3.1-8B shape: loads always beat recomputing
        load_bandwidth=50e9,
    )
    sched = Scheduler(args, ready)
    watch = _Watch(sched.kv)
    rng = random.Random(opts.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    system = tokens(opts.system_tokens)
    prompts = {
        c: system + tokens(opts.context_tokens + opts.user_tokens) for c in range(opts.clients)
    }
    rounds = dict.fromkeys(range(opts.clients), 0)
    queue = list(range(opts.clients))
    running: dict[str, int] = {}
    arrived: dict[str, int] = {}
    first: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    sampling = m.SamplingParams(max_new_tokens=opts.answer_tokens, temperature=0.0, ignore_eos=True)
    step = 0

    def send(batch: m.ForwardBatch, plan):
        nonlocal step
        step += 1
        return sampled_result(batch, VOCAB, step, forward_s=0.01)

    def submit() -> None:
        while queue and len(running) < opts.max_inflight:
            c = queue.pop(0)
            rid = f"c{c}r{rounds[c]}"
            running[rid], arrived[rid], outputs[rid] = c, step, []
            sched.add_request(
                m.GenerateReq(rid=rid, input_ids=m.pack_ids(prompts[c]), sampling=sampling)
            )

    submit()
    inflight = None
    while running:
        inflight, _ = advance(sched, inflight, send, sched.process_result)
        for out in sched.take_outputs():
            if out.error is not None:
                raise RuntimeError(f"{out.rid}: {out.error}")
            if out.new_ids:
                first.setdefault(out.rid, step)
                outputs[out.rid].extend(m.unpack_ids(out.new_ids).tolist())
            if out.finish_reason:
                c = running.pop(out.rid)
                answer = outputs[out.rid]
                if opts.diverge:  # the client sends back another second half
                    half = len(answer) // 2
                    answer = answer[:half] + [1 + t % (VOCAB - 1) for t in answer[half:]]
                prompts[c] = prompts[c] + answer + tokens(opts.user_tokens)
                rounds[c] += 1
                if rounds[c] < opts.rounds:
                    queue.append(c)
        submit()
        if step > 1_000_000:
            raise RuntimeError("no progress")
    while inflight is not None:
        inflight, _ = advance(sched, inflight, send, sched.process_result)
    per_round = []
    for r in range(opts.rounds):
        waits = [first[rid] - arrived[rid] for rid in arrived if rid.endswith(f"r{r}")]
        per_round.append(
            {
                "steps_to_first_token_p50": common.percentile(waits, 50),
                "steps_to_first_token_p90": common.percentile(waits, 90),
                "steps_to_first_token_max": int(max(waits)),
            }
        )
    stats = sched.cache_stats()
    return {
        "pool_tokens": pool,
        "host_tier": hicache,
        "steps": step,
        "turns": len(arrived),
        "admissions_refused": watch.refused,
        "min_page_margin_at_admission": watch.min_margin,
        "max_pages_held_at_admission": watch.max_held,
        "hit_rate": stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        "host_loads": stats.host_loads,
        "host_recomputed_tokens": stats.host_recomputed_tokens,
        "per_round": per_round,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--max-inflight", type=int, default=6)
    p.add_argument("--pool", type=int, default=22000, help="device pool (tokens) of the tier run")
    p.add_argument("--hicache-ratio", type=float, default=6.0)
    p.add_argument("--policy", default="write_through")
    p.add_argument("--unrestricted-tokens", type=int, default=400000, help="0: no such run")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--chunk", type=int, default=1024, help="--chunked-prefill-size")
    p.add_argument("--radix-tree-impl", default="auto")
    p.add_argument("--diverge", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    common.mark_run_start()
    runs = {"hicache": replay(opts, opts.pool, True)}
    if opts.unrestricted_tokens:
        runs["unrestricted"] = replay(opts, opts.unrestricted_tokens, False)
    for label, run in runs.items():
        rounds = " ".join(
            f"{r['steps_to_first_token_p50']:.0f}/{r['steps_to_first_token_max']}"
            for r in run["per_round"]
        )
        print(
            f"{label:<13} pool {run['pool_tokens']:>7}  refused {run['admissions_refused']}"
            f"  min margin {run['min_page_margin_at_admission']}"
            f"  max held {run['max_pages_held_at_admission']}  hit {run['hit_rate']:.3f}"
            f"  steps to first token p50/max per round: {rounds}"
        )
    result = {
        "provenance": common.provenance(
            "none: the scheduler's own counts (steps, refusals, page margins)", argv=argv
        ),
        "config": vars(opts),
        **runs,
    }
    if opts.out:
        common.write_json(opts.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
