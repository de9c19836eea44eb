"""Orders the waiting queue. Cache-aware policies from the SGLang paper, FCFS as the fallback."""

from __future__ import annotations

from collections import defaultdict

from radix_runtime.scheduler.request import Req

# Past this many waiting requests, matching every one of them each step costs more than the
# better order gains: fall back to FCFS (SGLang does the same).
LPM_QUEUE_LIMIT = 128


def order_waiting(policy: str, waiting: list[Req], match_len, match_node) -> list[Req]:
    """Return `waiting` in the order the scheduler should try to admit them.

    `match_len(req)` gives the cached prefix length, `match_node(req)` the deepest matched tree
    node (only dfs-weight needs it). Retracted requests keep their place in front: they already
    waited once.
    """
    if policy == "fcfs" or len(waiting) > LPM_QUEUE_LIMIT:
        return sorted(waiting, key=lambda r: (-r.retractions, r.arrival))
    if policy == "lpm":
        return sorted(waiting, key=lambda r: (-r.retractions, -match_len(r), r.arrival))
    if policy == "dfs-weight":
        return _dfs_weight(waiting, match_node)
    raise ValueError(f"unknown schedule policy {policy!r}")


def _dfs_weight(waiting: list[Req], match_node) -> list[Req]:
    """Visit the tree depth first, heavier subtrees (more waiting requests below) first.

    Requests sharing a cached prefix run back to back, so the prefix stays hot while it is used.
    """
    by_node: dict[int, list[Req]] = defaultdict(list)
    nodes: dict[int, object] = {}
    weight: dict[int, int] = defaultdict(int)
    children: dict[int, set[int]] = defaultdict(set)
    root_id = None
    for req in waiting:
        node = match_node(req)
        by_node[id(node)].append(req)
        nodes[id(node)] = node
        # walk up to the root, adding this request's weight to every ancestor
        while node is not None:
            weight[id(node)] += 1
            parent = getattr(node, "parent", None)
            if parent is None:
                root_id = id(node)
                nodes[root_id] = node
            else:
                children[id(parent)].add(id(node))
                nodes[id(parent)] = parent
            node = parent

    order: list[Req] = []
    stack = [root_id] if root_id is not None else []
    while stack:
        nid = stack.pop()
        order.extend(sorted(by_node.get(nid, ()), key=lambda r: r.arrival))
        # push lighter children first so the heaviest is popped next
        for child in sorted(children.get(nid, ()), key=lambda c: weight[c]):
            stack.append(child)
    seen = {id(r) for r in order}
    order.extend(r for r in waiting if id(r) not in seen)  # defensive: nodes off the root path
    retracted = [r for r in order if r.retractions]
    return retracted + [r for r in order if not r.retractions]
