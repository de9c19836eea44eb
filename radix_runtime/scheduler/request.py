"""A request as the scheduler sees it: token ids, the pages holding their KV, and its progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from radix_runtime.messages import SamplingParams


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class PageRow:
    """A request's page ids (int32), in a buffer that grows by doubling.

    A running request appends a page per decode step (page size 1) and hands slices of its row
    to the tree (insert), the allocator (free) and the worker (new pages) as numpy views: with
    32K-token histories a Python list cost a 32K-element conversion on every insert and on
    every admission. Slices are views into the buffer: whoever keeps one copies it (the trees
    and the allocator do)."""

    __slots__ = ("_buf", "_n")

    def __init__(self, pages=()) -> None:
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        self._n = len(pages)
        self._buf = np.empty(max(16, 2 * self._n), dtype=np.int32)
        self._buf[: self._n] = pages

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def view(self) -> np.ndarray:
        return self._buf[: self._n]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.view()
        return out if dtype is None else out.astype(dtype, copy=False)

    def __getitem__(self, index):
        return self.view()[index]

    def __setitem__(self, index, values) -> None:
        self.view()[index] = values

    def __iter__(self):
        return iter(self.view().tolist())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"PageRow({self.view().tolist()})"

    def append(self, page: int) -> None:
        self._make_room(self._n + 1)
        self._buf[self._n] = page
        self._n += 1

    def extend(self, pages) -> None:
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        end = self._n + len(pages)
        self._make_room(end)
        self._buf[self._n : end] = pages
        self._n = end

    def _make_room(self, size: int) -> None:
        if size > len(self._buf):
            buf = np.empty(max(2 * len(self._buf), size), dtype=np.int32)
            buf[: self._n] = self._buf[: self._n]
            self._buf = buf


@dataclass(eq=False)
class Req:
    rid: str
    prompt: np.ndarray  # int32
    sampling: SamplingParams
    arrival: int  # monotonically increasing arrival index (fcfs order)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    namespace: str | None = None  # the radix tree namespace it shares KV in (None: public)

    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING

    # KV state. `pages[:tree_pages]` belong to the radix tree (held by the lock on `node`);
    # the rest belong to this request. KV is computed for all_ids[:kv_len].
    pages: PageRow = field(default_factory=lambda: PageRow())
    tree_pages: int = 0
    node: object | None = None  # radix_cache.TreeNode, locked while the request runs
    kv_len: int = 0
    slot: int | None = None
    sent_pages: int = 0  # how many entries of `pages` the worker's page table already holds
    slot_started: bool = False  # the worker has seen this request in its slot
    # --hicache-prefetch arrival: while it waits, the tree node its host hit was loaded back
    # into on arrival (locked, so it stays on the device) and the tokens loaded
    prefetch_node: object | None = None
    prefetched_tokens: int = 0

    # accounting
    arrived_at: float = 0.0  # time.perf_counter() at the scheduler
    admitted_at: float = 0.0  # first admitted to a step
    cached_tokens: int = -1  # prefix length matched the first time the request was scheduled
    host_cached_tokens: int = 0  # of cached_tokens, loaded from the host tier
    retractions: int = 0
    finish_reason: str | None = None
    matched_stop: int | None = None
    error: str | None = None

    @property
    def all_len(self) -> int:
        return len(self.prompt) + len(self.output_ids)

    def all_ids(self) -> np.ndarray:
        if not self.output_ids:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.output_ids, dtype=np.int32)])

    def ids_slice(self, start: int, stop: int) -> np.ndarray:
        """all_ids()[start:stop] without concatenating the whole history."""
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        tail = np.asarray(self.output_ids[max(0, start - n) : stop - n], dtype=np.int32)
        if start >= n:
            return tail
        return np.concatenate([self.prompt[start:], tail])

    @property
    def remaining_fill(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.all_len - self.kv_len

    @property
    def is_decoding(self) -> bool:
        return self.state is ReqState.RUNNING and self.remaining_fill == 1 and bool(self.output_ids)

    @property
    def prefill_only(self) -> bool:
        return self.sampling.max_new_tokens == 0


@dataclass
class PlannedReq:
    """One row of a step: `num_tokens` of `req` computed from kv_len `start`, then sampled
    (`sample`) or not (a prefill chunk that does not reach the end)."""

    req: Req
    num_tokens: int
    sample: bool
    start: int = -1  # kv_len the row starts from (set by the planner; checked when processed)
