"""Micro benchmark of the radix tree (match / insert / evict) on a multi-turn chat op trace.

N clients share a system prompt; every round each client sends its whole history plus a new user
message, then "generates" an output; the finished request inserts prompt + output so the next
turn hits its history. A bounded number of requests is in flight (their matched nodes locked),
and the KV pool holds only a fraction of the trace's distinct tokens, so eviction runs.

    python bench/radix_tree.py                       # defaults: 64 clients x 16 rounds, both
    python bench/radix_tree.py --impl python         # one implementation
    python bench/radix_tree.py --page-size 16 --json out.json
    python bench/radix_tree.py --host-fraction 1.0   # with the host tier (docs/hicache.md)

Reports ops/s and microseconds per op by prefix-length bucket, the cache hit rate next to the
optimal (infinite cache) rate of the same trace, and a standalone match of an 8,192-token cached
prefix next to its floor: one numpy comparison of the same 8,192 tokens.

Only the tree calls themselves are timed, the same calls on both trees: `match_prefix(key)`,
`insert(key, pages)` and `evict(n)`. Building their arguments (the key and page slices, the
shortfall read off the allocator) is the caller's work, the same for both trees, and happens
before the clock starts.

Implementations are created by one factory per name in IMPLS, each with the scheduler's Python
page allocator, as the server pairs them (so an eviction's time includes freeing the pages
through it). By default both run on the same
trace, the Python tree (the reference) first, and the JSON holds one section per implementation
(`ops_per_s` over every timed op, `match_8k_cached_us`: the 16-edge 8,192-token match) and
`speedup` (cpp ops/s over python ops/s). The trace is replayed `--repeats` times per
implementation (default 5, interleaved: python, cpp, python, ...; a fresh tree each time) and
`ops_per_s` is the median replay's, with every replay's in `ops_per_s_runs`: one replay takes
about 0.1 s, so a single one is at the mercy of a busy machine.

With `--host-fraction F` (> 0) both trees run with the host tier (a host pool of F times the
trace's distinct tokens; `--write-through` for that policy, else write_back): device eviction
then writes nodes to the host, a match that reaches host-only nodes is loaded back as the
scheduler does (`load_back`, timed as the op "load"), and the queued copies are taken once per
request (`take_copies`, the op "copies"). The hit rate then counts both tiers.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional
    tqdm = None


# ---------------------------------------------------------------- implementations


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, progress: bool):
    if progress and tqdm is not None:
        return tqdm(total=total, unit="turn")
    return _NoBar()


def _host(host_pages: int, write_through: bool) -> dict:
    from radix_runtime.scheduler.allocator import PageAllocator

    if not host_pages:
        return {}
    return {"host_allocator": PageAllocator(host_pages), "write_through": write_through}


def make_python(page_size: int, num_pages: int, host_pages: int = 0, write_through: bool = False):
    from radix_runtime.scheduler.allocator import PageAllocator
    from radix_runtime.scheduler.radix_cache import RadixCache

    allocator = PageAllocator(num_pages)
    return allocator, RadixCache(page_size, allocator, **_host(host_pages, write_through))


def make_cpp(page_size: int, num_pages: int, host_pages: int = 0, write_through: bool = False):
    """The C++ tree (csrc/) with the scheduler's Python allocators, the pairing the server runs
    (scheduler/cache.py); ImportError when the extension is not built."""
    from radix_runtime.scheduler.allocator import PageAllocator
    from radix_runtime.scheduler.radix_cache_cpp import CppRadixCache

    allocator = PageAllocator(num_pages)
    return allocator, CppRadixCache(page_size, allocator, **_host(host_pages, write_through))


# name -> factory(page_size, num_pages, host_pages=0, write_through=False) -> (allocator, cache)
# with the interface of radix_runtime.scheduler.{allocator,radix_cache}.
IMPLS: dict[str, Callable] = {"python": make_python, "cpp": make_cpp}


# ---------------------------------------------------------------- timing


BUCKETS = [(0, 1024), (1024, 4096), (4096, 16384), (16384, 1 << 62)]


def bucket_name(lo: int, hi: int) -> str:
    return f"[{lo // 1024}k,{hi // 1024}k)" if hi < 1 << 62 else f"[{lo // 1024}k,inf)"


@dataclass
class OpTimes:
    """Per-op durations (ns), each with the prefix length it is bucketed by."""

    ns: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def add(self, ns: int, length: int) -> None:
        self.ns.append(ns)
        self.lengths.append(length)

    def summary(self) -> dict:
        ns = np.asarray(self.ns, dtype=np.float64)
        lengths = np.asarray(self.lengths)
        out = _summarize(ns)
        out["buckets"] = {}
        for lo, hi in BUCKETS:
            sel = (lengths >= lo) & (lengths < hi)
            if sel.any():
                out["buckets"][bucket_name(lo, hi)] = _summarize(ns[sel])
        return out


def _summarize(ns: np.ndarray) -> dict:
    if ns.size == 0:
        return {"count": 0}
    return {
        "count": int(ns.size),
        "ops_per_s": float(ns.size / (ns.sum() / 1e9)),
        "mean_us": float(ns.mean() / 1e3),
        "p50_us": float(np.percentile(ns, 50) / 1e3),
        "p99_us": float(np.percentile(ns, 99) / 1e3),
    }


# ---------------------------------------------------------------- the trace


@dataclass(frozen=True)
class TraceConfig:
    clients: int = 64
    rounds: int = 16
    system_len: int = 2048
    user_len: int = 128
    output_len: int = 256
    in_flight: int = 16
    page_size: int = 1
    pool_fraction: float = 0.5  # KV pool size / distinct tokens of the trace
    host_fraction: float = 0.0  # host pool size / distinct tokens (0: no host tier)
    write_through: bool = False  # the host tier's write policy (else write_back)
    vocab: int = 32000
    seed: int = 0

    def distinct_tokens(self) -> int:
        return self.system_len + self.clients * self.rounds * (self.user_len + self.output_len)


class TraceRunner:
    """Replays the multi-turn trace against one implementation, as the scheduler would."""

    def __init__(self, cfg: TraceConfig, factory: Callable):
        self.cfg = cfg
        ps = cfg.page_size
        pages_needed = -(-cfg.distinct_tokens() // ps)
        # Never smaller than what the in-flight requests can hold at once (else they get dropped).
        self.num_pages = max(int(pages_needed * cfg.pool_fraction), self._max_in_flight_pages())
        self.host_pages = int(pages_needed * cfg.host_fraction)
        self.allocator, self.cache = factory(
            ps, self.num_pages + 1, self.host_pages + 1 if self.host_pages else 0, cfg.write_through
        )
        self.times = {"match": OpTimes(), "insert": OpTimes(), "evict": OpTimes()}
        if self.host_pages:
            self.times.update(load=OpTimes(), copies=OpTimes())
        self.prompt_tokens = self.cached_tokens = self.optimal_tokens = self.host_tokens = 0
        self.evicted_pages = self.dropped = 0

    def _max_in_flight_pages(self) -> int:
        c = self.cfg
        longest = c.system_len + c.rounds * (c.user_len + c.output_len)
        return (-(-longest // c.page_size) + 1) * c.in_flight

    def run(self, progress: bool = True) -> None:
        cfg, ps = self.cfg, self.cfg.page_size
        rng = np.random.default_rng(cfg.seed)
        system = rng.integers(0, cfg.vocab, cfg.system_len, dtype=np.int32)
        histories = [system] * cfg.clients
        seen_system = False
        bar = _progress_bar(cfg.clients * cfg.rounds, progress)
        for _round in range(cfg.rounds):
            in_flight: list[tuple] = []
            for client in rng.permutation(cfg.clients):
                user = rng.integers(0, cfg.vocab, cfg.user_len, dtype=np.int32)
                prompt = np.concatenate([histories[client], user])
                optimal = len(histories[client]) if seen_system else 0
                seen_system = True
                self.optimal_tokens += min(optimal, len(prompt) - 1) // ps * ps
                output = rng.integers(0, cfg.vocab, cfg.output_len, dtype=np.int32)
                request = self._start(prompt, output)
                if request is not None:
                    in_flight.append((client, request))
                if len(in_flight) >= cfg.in_flight:
                    c, req = in_flight.pop(0)
                    histories[c] = self._finish(req)
                bar.update(1)
            for c, req in in_flight:
                histories[c] = self._finish(req)
        bar.close()
        self.cache.check_integrity(expect_unlocked=True)

    def _start(self, prompt: np.ndarray, output: np.ndarray):
        ps = self.cfg.page_size
        key = prompt[:-1]  # always leave one token to compute
        t0 = time.perf_counter_ns()
        m = self.cache.match_prefix(key)
        self.times["match"].add(time.perf_counter_ns() - t0, m.length)
        self.prompt_tokens += len(prompt)
        self.cached_tokens += m.length
        node, owned = m.node, m.pages
        if self.host_pages and m.host_length:  # load the host run back, as the scheduler does
            self.cache.lock(m.host_node)
            got = self._alloc(m.host_length // ps)
            if got is not None:
                t0 = time.perf_counter_ns()
                self.cache.load_back(m.host_node, got)
                self.times["load"].add(time.perf_counter_ns() - t0, m.host_length)
                node, owned = m.host_node, np.concatenate([m.pages, got])
                self.cached_tokens += m.host_length
                self.host_tokens += m.host_length
            else:
                self.cache.unlock(m.host_node)
        if node is m.node:
            self.cache.lock(m.node)
        full = np.concatenate([prompt, output])
        new = self._alloc(-(-len(full) // ps) - len(owned))
        if self.host_pages:
            t0 = time.perf_counter_ns()
            self.cache.take_copies()
            self.times["copies"].add(time.perf_counter_ns() - t0, 0)
        if new is None:  # cannot fit even after eviction: drop it (the bench sizes avoid this)
            self.cache.unlock(node)  # loaded pages belong to the tree already
            self.dropped += 1
            return None
        return full, np.concatenate([owned, new]), len(owned), node

    def _alloc(self, need: int):
        """`need` pages, evicting (timed) when the pool is short; None if even that fails."""
        new = self.allocator.alloc(need)
        if new is None:
            shortfall = need - self.allocator.free_pages
            t0 = time.perf_counter_ns()
            freed = self.cache.evict(shortfall)
            self.times["evict"].add(time.perf_counter_ns() - t0, freed * self.cfg.page_size)
            self.evicted_pages += freed
            new = self.allocator.alloc(need)
        return new

    def _finish(self, request) -> np.ndarray:
        full, pages, own, node = request
        ps = self.cfg.page_size
        whole = len(full) // ps
        key, key_pages = full[: whole * ps], pages[:whole]
        t0 = time.perf_counter_ns()
        r = self.cache.insert(key, key_pages)
        self.times["insert"].add(time.perf_counter_ns() - t0, whole * ps)
        self.allocator.free(np.concatenate([pages[own : r.prefix_len // ps], pages[whole:]]))
        self.cache.unlock(node)
        return full

    def report(self) -> dict:
        tier = {}
        if self.host_pages:
            tier = {
                "host_pages": self.host_pages,
                "host_hit_rate": self.host_tokens / max(1, self.prompt_tokens),
            }
        return {
            "num_pages": self.num_pages,
            **tier,
            "hit_rate": self.cached_tokens / max(1, self.prompt_tokens),
            "optimal_hit_rate": self.optimal_tokens / max(1, self.prompt_tokens),
            "evicted_pages": self.evicted_pages,
            "dropped_requests": self.dropped,
            "final_stats": self.cache.stats(),
            "ops": {name: t.summary() for name, t in self.times.items()},
        }


# ---------------------------------------------------------------- standalone match


def bench_long_match(factory: Callable, page_size: int, length: int, nodes: int, reps: int):
    """Match a cached `length`-token prefix spread over `nodes` edges; returns mean µs."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 32000, length + 1, dtype=np.int32)
    num_pages = length // page_size + 8
    allocator, cache = factory(page_size, num_pages + 1)
    cuts = np.linspace(0, length, nodes + 1).astype(int) // page_size * page_size
    for end in cuts[1:]:  # insert growing prefixes: one edge per turn, like a conversation
        m = cache.match_prefix(tokens[:end])
        new = allocator.alloc(end // page_size - len(m.pages))
        r = cache.insert(tokens[:end], np.concatenate([m.pages, new]))
        allocator.free(np.concatenate([m.pages, new])[len(m.pages) : r.prefix_len // page_size])
    query = tokens[: length + 1]
    assert cache.match_prefix(query).length == length
    return _median_us(lambda: cache.match_prefix(query), reps)


def bench_compare_floor(length: int, reps: int) -> float:
    """The floor under any match: one vectorised comparison of `length` int32 tokens."""
    a = np.random.default_rng(2).integers(0, 32000, length, dtype=np.int32)
    b = a.copy()
    return _median_us(lambda: np.array_equal(a, b), reps)


def _median_us(fn: Callable, reps: int) -> float:
    """Median of individually timed calls: robust to a busy machine, unlike a mean."""
    clock = time.perf_counter_ns
    ns = np.empty(reps, dtype=np.int64)
    for i in range(reps):
        t0 = clock()
        fn()
        ns[i] = clock() - t0
    return float(np.median(ns)) / 1e3


# ---------------------------------------------------------------- main


def print_report(impl: str, cfg: TraceConfig, trace: dict, micro: dict, wall_s: float) -> None:
    print(f"\nradix tree micro benchmark  impl={impl}  page_size={cfg.page_size}")
    print(
        f"trace: {cfg.clients} clients x {cfg.rounds} rounds, system {cfg.system_len}, "
        f"user {cfg.user_len}, output {cfg.output_len}, {cfg.in_flight} in flight, "
        f"pool {trace['num_pages']} pages ({cfg.pool_fraction:.0%} of distinct tokens)  "
        f"[{wall_s:.1f} s]"
    )
    print(
        f"hit rate {trace['hit_rate']:.1%} (optimal, infinite cache: "
        f"{trace['optimal_hit_rate']:.1%}); evicted {trace['evicted_pages']} pages; "
        f"dropped {trace['dropped_requests']} requests"
    )
    if "host_pages" in trace:
        print(
            f"host tier: {trace['host_pages']} pages ({cfg.host_fraction:.0%} of distinct tokens), "
            f"{'write_through' if cfg.write_through else 'write_back'}; "
            f"{trace['host_hit_rate']:.1%} of prompt tokens loaded from the host"
        )
    header = (
        f"{'op':<8}{'bucket':<13}{'count':>7}{'ops/s':>12}{'mean us':>10}{'p50 us':>9}{'p99 us':>9}"
    )
    print("buckets: match by matched tokens, insert by key tokens, evict by freed tokens")
    print(header)
    print("-" * len(header))
    for op, s in trace["ops"].items():
        rows = [("all", s)] + list(s.get("buckets", {}).items())
        for name, row in rows:
            if not row.get("count"):
                continue
            print(
                f"{op:<8}{name:<13}{row['count']:>7}{row['ops_per_s']:>12,.0f}"
                f"{row['mean_us']:>10.1f}{row['p50_us']:>9.1f}{row['p99_us']:>9.1f}"
            )
    print("-" * len(header))
    for key, value in micro.items():
        print(f"{key:<44}{value:>9.2f} us (median)")


def run_trace(name: str, cfg: TraceConfig, progress: bool) -> tuple[TraceRunner, float]:
    """One replay of the trace on a fresh tree; returns the runner and the wall time."""
    t0 = time.perf_counter()
    runner = TraceRunner(cfg, IMPLS[name])
    runner.run(progress=progress)
    return runner, time.perf_counter() - t0


def ops_per_s(runner: TraceRunner) -> float:
    """Every timed op of the trace (match, insert, evict) over their summed time."""
    times = runner.times.values()
    return sum(len(t.ns) for t in times) / (sum(sum(t.ns) for t in times) / 1e9)


def run_impl(name: str, cfg: TraceConfig, reps: int, runs: list[tuple[TraceRunner, float]]) -> dict:
    """The report of one implementation: its median trace replay (by ops/s) of `runs`, and the
    standalone matches."""
    rates = [ops_per_s(runner) for runner, _ in runs]
    runner, wall = runs[int(np.argsort(rates)[len(rates) // 2])]
    trace = runner.report()

    factory = IMPLS[name]
    ps = cfg.page_size
    micro = {
        "match 8192 cached tokens, 1 edge": bench_long_match(factory, ps, 8192, 1, reps),
        "match 8192 cached tokens, 16 edges": bench_long_match(factory, ps, 8192, 16, reps),
        "match 32768 cached tokens, 64 edges": bench_long_match(factory, ps, 32768, 64, reps // 4),
        "floor: np.array_equal of 8192 tokens": bench_compare_floor(8192, reps),
        "floor: np.array_equal of 32768 tokens": bench_compare_floor(32768, reps),
    }
    print_report(name, cfg, trace, micro, wall)
    if len(rates) > 1:
        print(f"ops/s of the {len(rates)} replays: " + ", ".join(f"{r:,.0f}" for r in rates))
    return {
        "ops_per_s": ops_per_s(runner),  # the median replay's
        "ops_per_s_runs": rates,
        "match_8k_cached_us": micro["match 8192 cached tokens, 16 edges"],
        "trace": trace,
        "micro_us": micro,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--impl",
        choices=[*sorted(IMPLS), "both"],
        default="both",
        help="both: python then cpp on the same trace, with the speedup (default)",
    )
    for f in TraceConfig.__dataclass_fields__.values():
        name = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            p.add_argument(name, action="store_true")
        else:
            p.add_argument(name, type=type(f.default), default=f.default)
    p.add_argument("--reps", type=int, default=2000, help="repetitions of the standalone match")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="replays of the trace per implementation, interleaved (python, cpp, python, ...); "
        "each reports its median replay by ops/s",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    cfg = TraceConfig(**{k: getattr(args, k) for k in TraceConfig.__dataclass_fields__})
    impls = ["python", "cpp"] if args.impl == "both" else [args.impl]

    result: dict = {
        "provenance": common.provenance(
            "the Python tree (scheduler/radix_cache.py) on the same trace, in the same run"
        ),
        "config": asdict(cfg),
        "repeats": args.repeats,
    }
    runs: dict[str, list] = {name: [] for name in impls}
    for _ in range(max(1, args.repeats)):  # interleaved, so that a busy spell hits both
        for name in impls:
            runs[name].append(run_trace(name, cfg, progress=not args.no_progress))
    for name in impls:
        result[name] = run_impl(name, cfg, args.reps, runs[name])
    if len(impls) == 2:
        py, cpp = result["python"], result["cpp"]
        result["speedup"] = cpp["ops_per_s"] / py["ops_per_s"]
        result["match_8k_speedup"] = py["match_8k_cached_us"] / cpp["match_8k_cached_us"]
        print(f"\n{'':<12}{'ops/s':>12}{'match 8k (16 edges)':>22}")
        for name in impls:
            r = result[name]
            print(f"{name:<12}{r['ops_per_s']:>12,.0f}{r['match_8k_cached_us']:>19.2f} us")
        print(
            f"speedup: {result['speedup']:.1f}x ops/s, {result['match_8k_speedup']:.1f}x match 8k "
            "(goals: >= 10x, match 8k <= 20 us)"
        )
    result.update(
        python_version=platform.python_version(),
        numpy=np.__version__,
        machine=platform.machine(),
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
