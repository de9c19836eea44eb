"""What the scheduler counts, for /get_server_info and /metrics, and the radix tree's
picture for /cache_tree.

`Counters` holds the totals since start; every part of the scheduler adds to the one instance.
`SchedulerStats` (none with --disable-metrics) adds the histograms, and `report()` hands the HTTP
process a `SchedulerMetrics`: the gauges as they are now, and the counters' and histograms'
increments since the previous report. The HTTP process adds them up, so the totals it exposes
only ever grow, whatever happens here. Recording is a few integer additions and bisects per step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from radix_runtime.messages import (
    CacheTree,
    CacheTreeNode,
    HistogramDelta,
    SchedulerMetrics,
    pack_ids,
)
from radix_runtime.utils.histogram import (
    BATCH_SIZE_BUCKETS,
    LATENCY_BUCKETS,
    STEP_BUCKETS,
    STEP_TOKENS_BUCKETS,
    Histogram,
)

# name -> bucket bounds of every histogram the scheduler ships (the HTTP side builds its totals
# from this table)
SCHEDULER_HISTOGRAMS: dict[str, tuple[float, ...]] = {
    # the tokenizer manager's send -> the scheduler's read (time in the scheduler's inbox)
    "inbox_time": STEP_BUCKETS,
    "queue_time": LATENCY_BUCKETS,  # arrival at the scheduler -> first admitted to a step
    "prefill_time": LATENCY_BUCKETS,  # first admitted -> first output token sampled
    "step_time": STEP_BUCKETS,  # a forward step, sent -> its result back at the scheduler
    "forward_time": STEP_BUCKETS,  # the worker's own time for a step (ForwardResult.forward_s)
    "launch_time": STEP_BUCKETS,  # the worker's host time to launch a step (launch_s)
    # how long a step's result, ready on the device, waited behind the next step's launch
    "result_held_time": STEP_BUCKETS,
    "batch_size": BATCH_SIZE_BUCKETS,  # requests in a step
    "step_tokens": STEP_TOKENS_BUCKETS,  # tokens computed in a step
}


@dataclass
class Counters:
    """The scheduler's totals since it started (/get_server_info), kept with or
    without --disable-metrics."""

    step_id: int = 0  # batches built
    prompt_tokens_total: int = 0  # prompt tokens of admitted requests (each counted once)
    cached_tokens_total: int = 0  # of them, matched in the tree (either tier)
    generation_tokens: int = 0  # output tokens (jump-forward's included)
    decode_steps: int = 0
    jumped_tokens: int = 0  # output tokens appended by jump-forward (no decode step each)
    retractions: int = 0
    evicted_pages: int = 0  # pages evicted from the tree to make room (a flush not counted)
    integrity_checks: int = 0
    host_cached_tokens_total: int = 0  # of cached_tokens_total, loaded from the host tier
    host_recomputed_tokens: int = 0  # host-tier hits computed again (the load did not pay)
    host_loads: int = 0
    host_loaded_bytes: int = 0
    host_written_bytes: int = 0
    host_load_s: float = 0.0
    host_load_runs: int = 0  # runs of consecutive host pages loaded: the worker's copies
    host_write_runs: int = 0
    host_copy_wait_s: float = 0.0  # the steps' wait for the host tier's copies (worker-timed)
    host_copy_issue_s: float = 0.0  # the worker's host time queueing them
    host_load_steps: int = 0  # steps with loads
    host_load_steps_waited: int = 0  # of them, loads that waited for the running steps
    host_write_steps: int = 0
    host_write_steps_waited: int = 0
    host_prefetches: int = 0  # requests whose host hit was loaded back on arrival
    host_prefetches_dropped: int = 0  # of them, unlocked again under memory pressure
    host_early_copies: int = 0  # HostCopies messages sent while a step ran


class SchedulerStats:
    """The histograms, and the reports of everything for /metrics."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self.hist = {name: Histogram(bounds) for name, bounds in SCHEDULER_HISTOGRAMS.items()}
        self._reported = Counters()  # the counters as of the previous report

    # -- recording (called by the scheduler) ---------------------------------------------

    def arrived(self, inbox_s: float) -> None:
        """A request read from the scheduler's socket `inbox_s` after the tokenizer sent it."""
        self.hist["inbox_time"].observe(max(inbox_s, 0.0))

    def admitted(self, queued_s: float) -> None:
        """A request's first admission (a retried one is not counted again)."""
        self.hist["queue_time"].observe(queued_s)

    def first_token(self, prefill_s: float) -> None:
        self.hist["prefill_time"].observe(prefill_s)

    def step(
        self,
        batch_size: int,
        tokens: int,
        step_s: float,
        forward_s: float,
        launch_s: float = 0.0,
        held_s: float = 0.0,
    ) -> None:
        h = self.hist
        h["batch_size"].observe(batch_size)
        h["step_tokens"].observe(tokens)
        h["step_time"].observe(step_s)
        h["forward_time"].observe(forward_s)
        h["launch_time"].observe(launch_s)
        h["result_held_time"].observe(held_s)

    # -- reporting ----------------------------------------------------------------------

    def report(self, sched) -> SchedulerMetrics:
        """Gauges now, and every increment since the previous report."""
        now, last = self.counters, self._reported
        msg = gauges(sched)
        msg.prompt_tokens = now.prompt_tokens_total - last.prompt_tokens_total
        msg.cached_tokens = now.cached_tokens_total - last.cached_tokens_total
        msg.host_cached_tokens = now.host_cached_tokens_total - last.host_cached_tokens_total
        msg.generation_tokens = now.generation_tokens - last.generation_tokens
        msg.retractions = now.retractions - last.retractions
        msg.evicted_pages = now.evicted_pages - last.evicted_pages
        msg.histograms = {
            name: HistogramDelta(h.counts, h.sum)
            for name, h in self.hist.items()
            if h.sum or any(h.counts)
        }
        for h in self.hist.values():
            h.clear()
        self._reported = replace(now)
        return msg


def gauges(sched) -> SchedulerMetrics:
    """The gauges as they are now, no increments (the whole answer with --disable-metrics)."""
    cache = sched.cache
    return SchedulerMetrics(
        running_requests=len(sched.running),
        waiting_requests=len(sched.waiting),
        total_pages=sched.allocator.total_pages,
        free_pages=sched.allocator.free_pages,
        evictable_pages=cache.evictable_pages,
        protected_pages=cache.protected_pages,
        page_size=sched.page_size,
        tree_nodes=cache.stats()["nodes"],
    )


# ---------------------------------------------------------------------------------------------
# the tree's top levels


HEAD_TOKENS = 16  # token ids of each edge's start sent for a preview


def cache_tree(cache, max_depth: int, max_children: int, max_nodes: int) -> CacheTree:
    """The top `max_depth` levels of the radix tree, each node with the tokens of its subtree.

    Works on either tree through the node interface (`children`, `key`, `pages`, `lock_ref`,
    `last_access`). Subtree sizes need the nodes below the shown levels too: the walk visits at
    most `max_nodes` nodes (breadth first); past that, sizes count only what was visited and
    `truncated` is set. Per node the `max_children` largest subtrees are listed, the others
    summed. Runs in the scheduler between steps: bounded by `max_nodes`."""
    root = cache.root
    clock = root.last_access  # every match and insert stamps the root with the newest tick
    # breadth-first: (node, parent visit index, depth)
    order: list[tuple[object, int, int]] = [(root, -1, 0)]
    sizes: list[int] = [0]
    edge: list[int] = [0]
    kids: list[list[int]] = [[]]
    queue = deque([0])
    truncated = False
    while queue:
        i = queue.popleft()
        node = order[i][0]
        for child in node.children.values():
            if len(order) > max_nodes:
                truncated = True
                queue.clear()
                break
            j = len(order)
            order.append((child, i, order[i][2] + 1))
            n = len(child.key)
            sizes.append(n)
            edge.append(n)
            kids.append([])
            kids[i].append(j)
            queue.append(j)
    for j in range(len(order) - 1, 0, -1):  # children come after their parents
        sizes[order[j][1]] += sizes[j]

    nodes: list[CacheTreeNode] = []

    def emit(i: int, parent: int) -> None:
        node, _, depth = order[i]
        shown = sorted(kids[i], key=lambda j: -sizes[j])
        children = shown[:max_children] if depth < max_depth else []
        rest = shown[len(children) :]
        key = node.key
        nodes.append(
            CacheTreeNode(
                parent=parent,
                tokens=edge[i],
                subtree_tokens=sizes[i],
                pages=len(node.pages),
                locked=node.lock_ref > 0,
                age=max(clock - node.last_access, 0),
                head=pack_ids(key[:HEAD_TOKENS]) if len(key) else b"",
                other_children=len(rest),
                other_tokens=sum(sizes[j] for j in rest),
            )
        )
        me = len(nodes) - 1
        for j in children:
            emit(j, me)

    emit(0, -1)
    return CacheTree(
        nodes=nodes,
        total_nodes=cache.stats()["nodes"],
        visited=len(order) - 1,
        truncated=truncated,
    )
