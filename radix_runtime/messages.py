"""Typed messages between the processes: msgspec Structs, msgpack-encoded, token arrays as raw int32.

Flows:
    tokenizer -> scheduler : GenerateReq, AbortReq, FlushCacheReq, ServerInfoReq, MetricsReq,
                             CacheTreeReq, ShutdownReq
    scheduler -> tokenizer : BatchOutput, ServerInfo, FlushCacheDone, SchedulerMetrics, CacheTree,
                             SchedulerReady, FatalError
    scheduler -> worker    : ForwardBatch, CompileGrammar, ShutdownReq
    worker    -> scheduler : WorkerReady, ForwardResult, GrammarCompiled, FatalError

Every message is a tagged Struct inside one union, so a single decoder reads any frame and a
foreign or malformed frame raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` (the
receiver logs and drops it). Nothing here is ever unpickled.
"""

from __future__ import annotations

from typing import Union

import msgspec
import numpy as np

# ---------------------------------------------------------------------------------------------
# token arrays travel as raw little-endian int32 bytes


def pack_ids(ids) -> bytes:
    """list[int] | np.ndarray -> raw int32 bytes."""
    return np.asarray(ids, dtype="<i4").tobytes()


def unpack_ids(buf: bytes) -> np.ndarray:
    """raw int32 bytes -> read-only np.ndarray[int32]."""
    return np.frombuffer(buf, dtype="<i4")


def pack_floats(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_floats(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<f4")


class _Msg(msgspec.Struct, tag=True, omit_defaults=True, array_like=False):
    pass


# ---------------------------------------------------------------------------------------------
# sampling


# `SamplingParams.json_schema` meaning "any JSON value" (SGLang's spelling); `{"type": "object"}`
# is any JSON object (what OpenAI's response_format json_object asks for)
ANY_JSON = "$$ANY$$"
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How to pick the next token. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logit_bias: dict[int, float] = {}
    # constrained decoding (at most one of the three; see docs/structured_output.md):
    # a regex, a JSON schema as JSON text (ANY_JSON: any JSON value), an EBNF grammar
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens were generated

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar constraining the output, None when unconstrained; the
        kind is "regex", "json_schema", "json" (any JSON value) or "ebnf"."""
        if self.json_schema is not None:
            if self.json_schema == ANY_JSON:
                return ("json", "")
            return ("json_schema", self.json_schema)
        if self.regex is not None:
            return ("regex", self.regex)
        if self.ebnf is not None:
            return ("ebnf", self.ebnf)
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


# ---------------------------------------------------------------------------------------------
# tokenizer <-> scheduler


class GenerateReq(_Msg):
    rid: str
    input_ids: bytes  # int32
    sampling: SamplingParams
    return_logprob: bool = False  # logprob of each output token
    top_logprobs_num: int = 0
    # >= 0: also return the logprob of every prompt token at positions >= this index
    # (the prefix match is capped so those positions are computed, not read from the cache)
    logprob_start_len: int = -1
    # the radix tree namespace the request shares cached KV in ("": the public one); set by the
    # tokenizer process from the cache salt and/or the caller's API key, never sent raw
    cache_namespace: str = ""
    # time.perf_counter() when the tokenizer manager sent it (the same host's monotonic clock):
    # the scheduler's `inbox_time` is its read time minus this
    sent_at: float = 0.0


class AbortReq(_Msg):
    rid: str


class FlushCacheReq(_Msg):
    pass


class FlushCacheDone(_Msg):
    ok: bool
    message: str = ""
    # what the flush dropped (every unlocked node) and what running requests still hold
    dropped_nodes: int = 0
    dropped_pages: int = 0
    dropped_tokens: int = 0
    kept_pages: int = 0


class ServerInfoReq(_Msg):
    pass


class CacheStats(msgspec.Struct, frozen=True):
    total_pages: int
    free_pages: int
    evictable_pages: int
    protected_pages: int
    page_size: int
    hit_rate: float  # cached prompt tokens / prompt tokens since start
    cached_tokens: int = 0
    prompt_tokens: int = 0
    tree: str = ""  # the radix tree implementation in use: "cpp" or "python"
    # the host tier (all 0 without --enable-hierarchical-cache); host_cached_tokens: prompt
    # tokens served by loading from the host (part of cached_tokens)
    host_total_pages: int = 0
    host_free_pages: int = 0
    host_evictable_pages: int = 0
    host_cached_tokens: int = 0
    host_loads: int = 0
    host_loaded_bytes: int = 0
    host_written_bytes: int = 0
    host_load_s: float = 0.0
    host_recomputed_tokens: int = 0  # host hits recomputed (the load did not pay, or no room)
    host_load_bandwidth: float = 0.0  # bytes/s of a host -> device copy, measured at start
    # runs of consecutive host pages among the loads / writes: the worker copies each as one
    # block (bytes loaded / host_load_runs = the mean copy)
    host_load_runs: int = 0
    host_write_runs: int = 0
    # time the model's steps waited for the host tier's copies (CUDA: the compute stream,
    # between reaching a step's copies and passing them; the CPU worker: the copies' wall time)
    host_copy_wait_s: float = 0.0
    # the worker's host time queueing the copies (part of its launch: under the overlap schedule
    # the previous step's result waits for it)
    host_copy_issue_s: float = 0.0
    # steps whose loads / writes waited for the steps still running (they touched a page of
    # theirs); the others ran beside the running step
    host_load_steps: int = 0
    host_load_steps_waited: int = 0
    host_write_steps: int = 0
    host_write_steps_waited: int = 0
    # --hicache-prefetch arrival: requests whose host hit was loaded back on arrival, their
    # prefetches given up under memory pressure, and the copy messages sent while a step ran
    host_prefetches: int = 0
    host_prefetches_dropped: int = 0
    host_early_copies: int = 0


class GrammarStats(msgspec.Struct, frozen=True):
    """Constrained decoding since start: requests with a grammar, how many found it compiled
    (the scheduler's cache of what the worker compiled), and the worker's compile times."""

    requests: int = 0
    cache_hits: int = 0
    compiles: int = 0
    failed: int = 0
    compile_p50_s: float = 0.0
    compile_p99_s: float = 0.0
    compile_max_s: float = 0.0


class GcStats(msgspec.Struct, frozen=True):
    """One process's garbage collections since it started serving (utils/gc_tuning.py)."""

    collections: int = 0
    full_collections: int = 0  # generation 2
    pause_s: float = 0.0  # total time in collections
    max_pause_s: float = 0.0
    long_pauses: int = 0  # collections of at least utils.gc_tuning.LONG_PAUSE_S
    frozen_objects: int = 0  # objects moved to the permanent generation (freeze_after_startup)


class ServerInfo(_Msg):
    cache: CacheStats
    running_requests: int
    waiting_requests: int
    max_total_tokens: int
    max_running_requests: int
    context_length: int
    vocab_size: int
    decode_steps: int = 0
    steps: int = 0  # forward steps sent to the worker
    jumped_tokens: int = 0  # output tokens appended by jump-forward decoding
    grammar: GrammarStats | None = None
    retractions: int = 0
    integrity_checks: int = 0
    kv_cache_dtype: str = ""  # the KV pool's element type (fp8_e4m3 holds twice bf16's tokens)
    quantization: str = "none"  # the weights' format
    gc: dict[str, GcStats] = {}  # per process: scheduler, worker (the tokenizer adds its own)


class MetricsReq(_Msg):
    pass


class HistogramDelta(msgspec.Struct, array_like=True):
    counts: list[int]  # per bucket (utils.histogram's bounds, +Inf last), since the last report
    sum: float


class SchedulerMetrics(_Msg):
    """The scheduler's (and, through ForwardResult, the worker's) numbers for /metrics: gauges as
    they are now, counters and histograms as increments since the previous SchedulerMetrics, so
    the HTTP process owns the totals and they only ever grow."""

    running_requests: int
    waiting_requests: int
    total_pages: int
    free_pages: int
    evictable_pages: int
    protected_pages: int
    page_size: int
    tree_nodes: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, loaded from the host tier
    generation_tokens: int = 0
    retractions: int = 0
    evicted_pages: int = 0
    histograms: dict[str, HistogramDelta] = {}


class CacheTreeReq(_Msg):
    max_depth: int = 4
    max_children: int = 8  # per node, the largest subtrees; the rest are summed into `other`
    max_nodes: int = 20000  # nodes visited to size subtrees; past it the sizes are lower bounds


class CacheTreeNode(msgspec.Struct, array_like=True):
    parent: int  # index into CacheTree.nodes, -1 for the root
    tokens: int  # on this edge
    subtree_tokens: int  # on this edge and below it
    pages: int
    locked: bool
    age: int  # LRU clock ticks since the last match or insert through it (0: the newest)
    head: bytes  # int32: the edge's first tokens
    other_children: int = 0  # children left out (max_children)
    other_tokens: int = 0  # tokens under them


class CacheTree(_Msg):
    nodes: list[CacheTreeNode]
    total_nodes: int  # in the tree (the root excluded)
    visited: int
    truncated: bool  # max_nodes stopped the walk: subtree sizes are lower bounds


class ReqOutput(msgspec.Struct, omit_defaults=True):
    """What one request gained in one step."""

    rid: str
    new_ids: bytes = b""  # int32, output tokens appended this step
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    matched_stop: int | None = None  # the stop token id that ended it
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, loaded from the host tier
    output_logprobs: bytes = b""  # float32, one per new id
    # top-k per new id: k ids and k logprobs each, flattened
    top_ids: bytes = b""
    top_logprobs: bytes = b""
    # prompt logprobs for positions [prompt_logprob_start, ...) gained this step
    prompt_logprob_start: int = -1
    prompt_logprobs: bytes = b""
    # with top_logprobs_num = k > 0: the top-k ids and logprobs of each of those positions
    prompt_top_ids: bytes = b""
    prompt_top_logprobs: bytes = b""
    error: str | None = None
    error_code: str | None = None


class BatchOutput(_Msg):
    outputs: list[ReqOutput]
    # time.perf_counter() when the scheduler sent it: the tokenizer manager's
    # `first_token_transit` is its receipt of a first token minus this
    sent_at: float = 0.0


class SchedulerReady(_Msg):
    max_total_tokens: int
    page_size: int
    context_length: int
    vocab_size: int
    max_running_requests: int


class FatalError(_Msg):
    role: str
    message: str


class ShutdownReq(_Msg):
    pass


# ---------------------------------------------------------------------------------------------
# scheduler <-> worker


class ForwardReq(msgspec.Struct, omit_defaults=True):
    """One request's share of a forward step.

    The worker keeps a page table per slot (a row of ``req_to_page``); the scheduler sends only
    the pages the worker has not seen yet: ``new_pages`` go to positions
    ``[page_offset, page_offset + len(new_pages))`` of the slot's row.
    """

    slot: int
    input_ids: bytes  # int32: the tokens computed this step (a prefill chunk, or one decode token)
    start_pos: (
        int  # tokens of this request already in the KV cache (cached prefix + earlier chunks)
    )
    page_offset: int = 0
    new_pages: bytes = b""  # int32
    new_slot: bool = False  # first step of this request in this slot: reset per-slot state
    sample: bool = True  # False for a prefill chunk that does not reach the end of the prompt
    sampling: SamplingParams | None = None  # sent with new_slot (and kept by the worker)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    prompt_logprobs: bool = False  # return logprob of input_ids[1:] (+ next_token) given the prefix
    next_token: int = -1  # the prompt token after this chunk (for prompt logprobs), -1 if none
    # with new_slot, when the request uses penalties: the tokens before start_pos (cached or
    # computed in an earlier slot) and the outputs generated before a retraction, so
    # repetition/frequency/presence penalties see the whole history; prior_output_ids also
    # with a grammar (its matcher replays them) or min_tokens (they count)
    history_ids: bytes = b""  # int32
    prior_output_ids: bytes = b""  # int32
    # overlap schedule: the single input token is the one this slot sampled in the worker's
    # latest step that sampled it (still on the device: the scheduler does not know it yet);
    # input_ids must then be empty
    from_last_sample: bool = False


class ForwardBatch(_Msg):
    step: int
    reqs: list[ForwardReq]
    # slots whose per-request worker state (seeded generator, penalty counts) can be dropped
    released_slots: list[int] = []
    # the host KV tier (docs/hicache.md): copies the worker makes before this step's model runs,
    # as int32 page-id buffers, one id per page: device -> host writes, then host -> device loads
    write_src: bytes = b""
    write_dst: bytes = b""
    load_src: bytes = b""
    load_dst: bytes = b""
    # the step overwrites device pages a write of this batch reads: it waits for the writes
    writes_block: bool = False


class HostCopies(_Msg):
    """Host-tier copies sent on their own, between steps (--hicache-prefetch arrival): the loads
    of requests read while a step runs, so the copies start before the batch that reads them is
    built. The worker makes them at once, as a batch's (`ForwardBatch.write_src` ...), and every
    later step is ordered after them."""

    write_src: bytes = b""
    write_dst: bytes = b""
    load_src: bytes = b""
    load_dst: bytes = b""
    writes_block: bool = False


class ForwardReqResult(msgspec.Struct, omit_defaults=True):
    next_id: int = -1  # -1 when sample was False
    # constrained: the grammar ended with next_id (it accepted a stop token), or next_id broke it
    grammar_done: bool = False
    grammar_error: str | None = None
    # --enable-jump-forward: tokens the grammar forces after next_id (already accepted by its
    # matcher): outputs that the next step computes in one go instead of a decode step each
    jump_ids: bytes = b""  # int32
    logprob: float = 0.0
    top_ids: bytes = b""
    top_logprobs: bytes = b""
    prompt_logprobs: bytes = b""  # float32, one per input position whose target is known
    # with top_logprobs_num = k > 0: k per such position (echo of prompt logprobs)
    prompt_top_ids: bytes = b""  # int32
    prompt_top_logprobs: bytes = b""  # float32


class ForwardResult(_Msg):
    step: int
    results: list[ForwardReqResult]
    forward_s: float = 0.0
    load_s: float = 0.0  # the host -> device loads of this step, as the copy stream timed them
    copy_wait_s: float = 0.0  # how long this step's model waited for the host tier's copies
    copy_issue_s: float = 0.0  # the worker's host time queueing them (HostKVPool.copy)
    load_waited: bool = False  # its loads waited for the steps still running (a page of theirs)
    write_waited: bool = False  # its writes did
    # the worker's host time to launch this step (ModelRunner.launch + sample: host preparation,
    # the host tier's copies queued, the model and sampling enqueued)
    launch_s: float = 0.0
    # how long this step's collection waited behind the launch of the step after it (the overlap
    # schedule launches N+1 before collecting N): a result the device had ready sat this long
    held_s: float = 0.0
    # the worker's collections so far, when a full or long one happened since its last report
    gc: GcStats | None = None


class CompileGrammar(_Msg):
    """Compile a grammar (SamplingParams.grammar's kind and text) ahead of the requests using it."""

    kind: str
    text: str


class GrammarCompiled(_Msg):
    """A CompileGrammar's outcome: `error` set when the grammar is invalid."""

    kind: str
    text: str
    error: str | None = None
    compile_s: float = 0.0
    cache_hit: bool = False


class WorkerReady(_Msg):
    num_pages: int  # pages in the KV pool, including the reserved page 0
    page_size: int
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    attention_backend: str
    # the host KV tier: its pages (0: none, including the reserved page 0), bytes of KV per
    # token, and the host-to-device copy bandwidth measured at start (bytes/s)
    host_num_pages: int = 0
    kv_bytes_per_token: int = 0
    load_bandwidth: float = 0.0
    kv_cache_dtype: str = ""  # the KV pool's element type: bfloat16, float32, fp8_e4m3...
    quantization: str = "none"  # the weights': none | fp8 | awq | gptq (worker/quant.py)
    max_running_requests: int = 0  # request slots (0: not reported; the scheduler sizes them)


Message = Union[
    GenerateReq,
    AbortReq,
    FlushCacheReq,
    FlushCacheDone,
    ServerInfoReq,
    ServerInfo,
    MetricsReq,
    SchedulerMetrics,
    CacheTreeReq,
    CacheTree,
    BatchOutput,
    SchedulerReady,
    FatalError,
    ShutdownReq,
    ForwardBatch,
    HostCopies,
    ForwardResult,
    CompileGrammar,
    GrammarCompiled,
    WorkerReady,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> Message:
    """Raises msgspec.DecodeError / msgspec.ValidationError on a malformed or foreign frame."""
    return _decoder.decode(frame)
