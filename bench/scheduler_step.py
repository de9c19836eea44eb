"""The scheduler's CPU time per step with each radix tree: 256 running requests, 32k histories.

256 multi-turn conversations, each with a cached history of about 32k tokens, run against a fake
worker that returns a token id per request at once (no model, no per-token Python work), so
what is timed is the scheduler alone: `schedule()` + `process_result()` per step. Every request
decodes for a while and finishes; its conversation's next turn (history + answer + a new user
message) arrives right away, hits the whole history in the tree and is prefilled in a chunk.
So a step is mostly 256 decodes, plus the tree work around turns: a match of each waiting
request per step (LPM order), match + lock on admission, insert + match after the prefill chunk,
insert + unlock when a request finishes.

    python bench/scheduler_step.py                   # python and cpp trees, page size 1
    python bench/scheduler_step.py --page-size 16 --steps 1000 --json out.json

Rows: `python` (the Python tree) and `cpp` (the C++ tree), each with the scheduler's own Python
page allocator, as the server runs them. The tree-only cost of the same step is printed beside
it: the time spent inside the cache's methods.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402
from radix_runtime import messages as m  # noqa: E402
from radix_runtime.config import ServerArgs  # noqa: E402
from radix_runtime.scheduler.scheduler import Scheduler  # noqa: E402

VOCAB = 32000
EOS = 0
CACHE_METHODS = ("match_prefix", "insert", "lock", "unlock", "evict")


@dataclass(frozen=True)
class StepConfig:
    requests: int = 256
    history: int = 32768 - 512  # cached tokens per conversation at the start
    user_len: int = 64
    min_output: int = 32
    max_output: int = 160
    page_size: int = 1
    chunk: int = 2048  # --chunked-prefill-size
    warmup: int = 200  # steps before timing: every conversation running, turns under way
    steps: int = 500
    seed: int = 0


class FakeWorker:
    """Answers every sampled request with a token id; touches no KV and loops over no tokens."""

    def __init__(self, num_pages: int, cfg: StepConfig):
        self.ready = m.WorkerReady(
            num_pages=num_pages,
            page_size=cfg.page_size,
            context_length=cfg.history + 16384,
            vocab_size=VOCAB,
            eos_token_ids=[EOS],
            device="cpu",
            dtype="int",
            attention_backend="fake",
        )
        self.empty = m.ForwardReqResult()

    def forward(self, batch: m.ForwardBatch) -> m.ForwardResult:
        results = [
            m.ForwardReqResult(next_id=1 + (r.slot * 131 + batch.step) % (VOCAB - 1))
            if r.sample
            else self.empty
            for r in batch.reqs
        ]
        return m.ForwardResult(step=batch.step, results=results)


class CacheTimer:
    """Wraps the scheduler's cache so that the time inside its methods is summed."""

    def __init__(self, cache):
        self._cache = cache
        self.ns = 0
        for name in CACHE_METHODS:
            setattr(self, name, self._timed(getattr(cache, name)))

    def _timed(self, fn):
        clock = time.perf_counter_ns

        def timed(*args):
            t0 = clock()
            try:
                return fn(*args)
            finally:
                self.ns += clock() - t0

        return timed

    def __getattr__(self, name):
        return getattr(self._cache, name)


def run(impl: str, cfg: StepConfig) -> dict:
    rng = np.random.default_rng(cfg.seed)
    ps = cfg.page_size
    longest = cfg.history + 4 * (cfg.user_len + cfg.max_output) + cfg.steps + cfg.warmup
    num_pages = cfg.requests * (longest // ps + 2) + 1024
    args = ServerArgs(
        page_size=ps,
        max_running_requests=cfg.requests,
        chunked_prefill_size=cfg.chunk,
        radix_tree_impl=impl,
    )
    worker = FakeWorker(num_pages, cfg)
    sched = Scheduler(args, worker.ready)

    # Cache every conversation's history (a shared 2k system prompt, then its own tokens).
    system = rng.integers(1, VOCAB, 2048, dtype=np.int32)
    histories = []
    for _ in range(cfg.requests):
        history = np.concatenate([system, rng.integers(1, VOCAB, cfg.history - 2048)])
        history = history.astype(np.int32)
        match = sched.cache.match_prefix(history)
        pages = np.concatenate(
            [match.pages, sched.allocator.alloc(len(history) // ps - len(match.pages))]
        )
        res = sched.cache.insert(history, pages)
        sched.allocator.free(pages[len(match.pages) : res.prefix_len // ps])
        histories.append(history)
    timer = CacheTimer(sched.cache)
    sched.kv.cache = timer

    prompts: dict[str, np.ndarray] = {}
    answers: dict[str, list[int]] = {}
    turn = [0] * cfg.requests

    def arrive(conv: int, history: np.ndarray) -> None:
        rid = f"c{conv}-t{turn[conv]}"
        turn[conv] += 1
        prompt = np.concatenate([history, rng.integers(1, VOCAB, cfg.user_len, dtype=np.int32)])
        prompts[rid] = prompt
        answers[rid] = []
        out = int(rng.integers(cfg.min_output, cfg.max_output + 1))
        sched.add_request(
            m.GenerateReq(
                rid=rid,
                input_ids=m.pack_ids(prompt),
                sampling=m.SamplingParams(max_new_tokens=out, temperature=0.0, ignore_eos=True),
            )
        )

    for conv, history in enumerate(histories):
        arrive(conv, history)

    step_ns, tree_ns, running, finished = [], [], [], 0
    clock = time.perf_counter_ns
    for step in range(cfg.warmup + cfg.steps):
        tree_before = timer.ns
        t0 = clock()
        scheduled = sched.schedule()
        t1 = clock()
        assert scheduled is not None, "the scheduler ran out of work"
        batch, plan = scheduled
        result = worker.forward(batch)
        t2 = clock()
        sched.process_result(plan, result)
        t3 = clock()
        if step >= cfg.warmup:
            step_ns.append((t1 - t0) + (t3 - t2))
            tree_ns.append(timer.ns - tree_before)
            running.append(len(sched.running))
        for out in sched.take_outputs():
            assert out.error is None, out.error
            if out.new_ids:
                answers[out.rid].extend(m.unpack_ids(out.new_ids).tolist())
            if out.finish_reason:
                conv = int(out.rid[1:].split("-")[0])
                history = np.concatenate([prompts.pop(out.rid), answers.pop(out.rid)])
                finished += step >= cfg.warmup
                arrive(conv, history.astype(np.int32))
    sched.kv.cache = timer._cache
    ns = np.asarray(step_ns, dtype=np.float64)
    tree = np.asarray(tree_ns, dtype=np.float64)
    return {
        "step_us_mean": float(ns.mean() / 1e3),
        "step_us_p50": float(np.percentile(ns, 50) / 1e3),
        "step_us_p99": float(np.percentile(ns, 99) / 1e3),
        "tree_us_mean": float(tree.mean() / 1e3),
        "running_mean": float(np.mean(running)),
        "turns_finished": finished,
        "cache": sched.cache.stats(),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    for f in StepConfig.__dataclass_fields__.values():
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    cfg = StepConfig(**{k: getattr(args, k) for k in StepConfig.__dataclass_fields__})

    impls = ["python"]
    try:
        import radix_runtime.scheduler.radix_cache_cpp  # noqa: F401

        impls.append("cpp")
    except ImportError as exc:
        print(f"the C++ tree is not built ({exc}): python only")
    result: dict = {
        "provenance": common.provenance("the same steps with the Python tree, in the same run"),
        "config": asdict(cfg),
    }
    print(
        f"scheduler step: {cfg.requests} requests, {cfg.history}-token cached histories, "
        f"user {cfg.user_len}, output {cfg.min_output}-{cfg.max_output}, page size "
        f"{cfg.page_size}, chunk {cfg.chunk}; {cfg.steps} steps timed after {cfg.warmup}"
    )
    header = f"{'tree':<20}{'mean us':>10}{'p50 us':>10}{'p99 us':>10}{'in tree us':>12}{'running':>9}{'turns':>7}"
    print(header)
    print("-" * len(header))
    for name in impls:
        r = result[name] = run(name, cfg)
        print(
            f"{name:<20}{r['step_us_mean']:>10.0f}{r['step_us_p50']:>10.0f}{r['step_us_p99']:>10.0f}"
            f"{r['tree_us_mean']:>12.0f}{r['running_mean']:>9.0f}{r['turns_finished']:>7}"
        )
    result.update(python_version=platform.python_version(), machine=platform.machine())
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
