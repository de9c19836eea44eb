"""ModelRunner: one forward step of a ForwardBatch -> ForwardResult.

The runner owns the tensors (weights, KV pool, the per-slot page table, sampler state) and
no policy: the scheduler says which pages each request reads and writes. One step:
    1. update the page table rows with the pages the scheduler sent,
    2. build the batch's paged layout (AttentionMetadata) and plan the attention backend once,
    3. run the model over the flat batch of new tokens,
    4. compute logits only on the rows that need them (the last row of a sampled request; every
       row of a request that asked for prompt logprobs), sample, and pack the results.

A step is split in two for the overlap schedule: `launch(batch)` does the host preparation and
enqueues all device work, sampling included, without waiting for the device: the sampled ids
land in `last_sampled[slot]` (device) and are copied asynchronously into pinned host memory,
then a CUDA event is recorded. `collect(pending)` waits on that event and builds the
`ForwardResult`. A request with `from_last_sample` feeds the token its slot sampled in the latest
launched step that sampled it: gathered on the device from `last_sampled`, so the next step can be
queued before the host has seen the token. `forward(batch) == collect(launch(batch))`. On the CPU
the same code runs: launch does the work, collect packs it.

Constrained rows sample from a mask the host fills from the token each row sampled in the step
before. `launch(batch, defer_sample=True)` then stops after queueing the forward; the worker
loop collects (and sends) the previous step's result and only then calls `sample(pending)`,
which accepts the tokens, fills the masks and queues the sampling: the scheduler builds the
next batch while the host fills the masks and the device runs the forward. A deferred sampling
is done before anything else is queued (the next launch, or collect).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs, auto_grammar_fill_threads, auto_max_running_requests
from radix_runtime.worker import cpu_native
from radix_runtime.worker.attention import create_backend, resolve_backend_name
from radix_runtime.worker.attention.base import AttentionMetadata
from radix_runtime.worker.cuda_graph import CudaGraphRunner, ExtendGraphRunner
from radix_runtime.worker.distributed import TPRank
from radix_runtime.worker.host_copy import to_device
from radix_runtime.worker.host_pool import (
    CopyTiming,
    HostKVPool,
    StepPages,
    host_pool_pages,
    measure_load_bandwidth,
)
from radix_runtime.worker.kernels import KernelConfig
from radix_runtime.worker.kernels import available as kernels_available
from radix_runtime.worker.kv_pool import KVPool, kv_storage_dtype, num_pages_for
from radix_runtime.worker.loader import load_model
from radix_runtime.worker.sampler import DeviceSample, Sampler, target_logprobs

logger = logging.getLogger(__name__)

NO_GRAMMAR = "constrained decoding is not available (xgrammar is not installed)"
# a CPU step of at most this many tokens runs on --cpu-small-step-threads intra-op threads (by
# default all of them; 1 for a machine where other jobs hold cores: there every parallel region
# of a step waits for a thread that is not running, docs/decisions.md "A cached turn's chunk")
SMALL_STEP_TOKENS = 2
# ... and so does a lone request's step of at most this many (a chat's next turn over its cached
# history)
SMALL_CHUNK_TOKENS = 32
_PLACEHOLDER = np.zeros(1, np.int32)  # a from_last_sample row's input id on the host
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but CUDA is not available")
    return torch.device(name)


def cpu_threads(ranks_here: int = 1) -> int:
    """Intra-op threads for the CPU path: OMP_NUM_THREADS when set, else the cores this process
    may run on (its affinity mask, which a container or `taskset` narrows; torch's default counts
    every core of the host), split between the `ranks_here` tensor-parallel ranks on them."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass
class _StepLayout:
    """Host-side view of one batch, built before anything runs on the device."""

    input_ids: torch.Tensor  # [N] int64 on the device
    meta: AttentionMetadata
    ids: list[np.ndarray]  # per request, its input ids
    logit_rows: np.ndarray  # batch token rows whose logits are computed
    logit_ranges: list[tuple[int, int]]  # per request, its rows within `logit_rows`
    pages: StepPages  # the KV pages the step reads and writes


@dataclass
class PendingStep:
    """A launched step: its device work is queued; `collect` waits for it and packs the result."""

    step: int
    reqs: list[m.ForwardReq]
    t0: float
    sample: DeviceSample | None = None  # the sampled rows' tokens (and logprobs), on the device
    sampled: list[int] | None = None  # indices into `reqs` of the requests that sampled
    prompt_rows: list[int] | None = None  # indices into `reqs` of the prompt-logprob requests
    host: list[torch.Tensor] | None = None  # sample.tensors() + prompt logprobs, on the host
    event: torch.cuda.Event | None = None  # recorded after the device-to-host copies
    logits: list[torch.Tensor | None] | None = None  # per request (forward_with_logits)
    load: CopyTiming | None = None  # the host tier's copy timing (HostKVPool.load_time)
    # copies sent on their own (HostCopies) since the step before was launched
    early: list[CopyTiming] = field(default_factory=list)
    deferred: tuple | None = None  # (layout, logits, keep_logits) until `sample` runs
    launch_s: float = 0.0  # the worker loop's host time to launch it (ForwardResult.launch_s)

    def ready(self) -> bool:
        """True when `collect` would not wait (always, off CUDA)."""
        return self.event is None or self.event.query()


class ModelRunner:
    def __init__(
        self, args: ServerArgs, kernels: KernelConfig | None = None, tp: TPRank | None = None
    ) -> None:
        """`kernels`: the CUDA path's kernel choices (default: what serving runs). `tp`: this
        worker's tensor-parallel rank (worker/distributed.py); it holds that rank's share of the
        model and of the KV pool, and joins the others' collectives."""
        self.args = args
        self.kernels = kernels or KernelConfig(pdl=not args.disable_pdl)
        self.tp = tp or TPRank()
        self.device = self.tp.pin(pick_device(args.device))
        self.dtype = pick_dtype(args.dtype, self.device)
        # CPU intra-op threads: all of this rank's cores, and `small_step_threads` for a step of
        # at most SMALL_STEP_TOKENS tokens or a lone request's of SMALL_CHUNK_TOKENS
        # (`_cpu_threads_for`)
        self.threads = self.small_step_threads = 0
        if self.device.type == "cpu":
            self.threads = cpu_threads(ranks_here=args.tp // args.nnodes)
            small = args.cpu_small_step_threads
            self.small_step_threads = min(small, self.threads) if small else self.threads
            torch.set_num_threads(self.threads)
        torch.manual_seed(args.seed)
        self.tp.join(self.device)
        # int4 weights stay packed where the int4 GEMV runs (CUDA, with the kernels)
        packed_int4 = self.device.type == "cuda" and self.kernels.int4_gemv and kernels_available()
        loaded = load_model(args, self.device, self.dtype, packed_int4, self.tp)
        self.model, self.config, self.load_s = loaded.model, loaded.config, loaded.load_s
        self.dtype, self.weight_format = loaded.dtype, loaded.weight_format
        self.model_name = loaded.source.name
        self.kv_scales = loaded.kv_scales  # per layer (k, v) from the checkpoint, for an FP8 pool
        self.quantization = loaded.quantization
        self._no_grammar: list[m.GrammarCompiled] = []
        c = self.config
        self.page_size = args.page_size
        self.context_length = args.context_length or c.max_position_embeddings
        self.kv_pool = self._allocate_kv_pool()
        self.host_pool: HostKVPool | None = None
        self.load_bandwidth = 0.0
        if args.enable_hierarchical_cache and not args.disable_radix_cache:
            self.host_pool = self._allocate_host_pool()
        self.attn = create_backend(
            self._backend_name(),
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            self.device,
            scale=c.softmax_scale,
            layer_windows=c.layer_windows,
            kernels=self.kernels,
        )
        self.attn.bind_pool(self.kv_pool)
        if self.device.type == "cpu" and not args.disable_cpu_native_decoder:
            self.model.cpu_decoder = cpu_native.build(self.model, self.kv_pool, self.attn)
        self.max_pages_per_slot = math.ceil(self.context_length / self.page_size) + 1
        # request slots: --max-running-requests, else sized from the pool and, when decode steps
        # are graphed, the largest graph (the scheduler is told)
        graphed = self.attn.supports_cuda_graph and not args.disable_cuda_graph
        self.max_running = args.max_running_requests or auto_max_running_requests(
            (self.kv_pool.num_pages - 1) * self.page_size,
            args.cuda_graph_max_bs if graphed else None,
        )
        # req_to_page[slot, i]: the page holding positions [i * page_size, (i + 1) * page_size)
        self.req_to_page = np.zeros((self.max_running, self.max_pages_per_slot), np.int32)
        self.grammars = self._grammar_cache(loaded.source)
        self.sampler = Sampler(
            c.vocab_size,
            self.device,
            args.seed,
            list(c.eos_token_ids),
            self.grammars,
            jump_forward=args.enable_jump_forward,
            fill_threads=self._fill_threads(),
        )
        self._deferred: PendingStep | None = None  # launched with its sampling not queued yet
        # the KV pages each launched, not yet collected step reads and writes (by step): a host
        # tier copy that touches none of them need not wait for those steps (HostKVPool.copy)
        self._in_flight: dict[int, StepPages] = {}
        self._early: list[CopyTiming] = []  # HostCopies made since the last launch
        self._unread: list[CopyTiming] = []  # copy times not done when their step was
        # the token each slot sampled last, on the device (the sampler's slot state says whether
        # there is one since the slot opened)
        self.last_sampled = torch.zeros(self.max_running, dtype=torch.long, device=self.device)
        if self._fused_ops_available():
            self.use_kernels(self.kernels)
        self.cuda_graphs: CudaGraphRunner | None = None
        if self.attn.supports_cuda_graph and not args.disable_cuda_graph:
            max_bs = min(args.cuda_graph_max_bs, self.max_running)
            self.cuda_graphs = CudaGraphRunner(
                self.model, self.attn, self.kv_pool, max_bs, self.max_pages_per_slot, self.device
            )
        self.extend_graphs: ExtendGraphRunner | None = None
        if (
            self.attn.supports_extend_graph
            and not args.disable_cuda_graph
            and args.cuda_graph_max_extend_tokens > 0
        ):
            self.extend_graphs = ExtendGraphRunner(
                self.model,
                self.attn,
                self.kv_pool,
                args.cuda_graph_max_extend_tokens,
                self.max_running,
                self.max_pages_per_slot,
                self.device,
            )
        self.tp.barrier(self.device)  # rank 0 reports ready once every rank is
        logger.info(
            "worker ready: %s on %s/%s, %d KV pages x %d tokens, backend %s, CUDA graphs %s%s",
            self.model_name, self.device, self.dtype, self.kv_pool.num_pages, self.page_size,
            self.attn.name, "on" if self.cuda_graphs else "off",
            f", tp rank {self.tp.rank}/{self.tp.size}" if self.tp.enabled else "",
        )  # fmt: skip

    def _fill_threads(self) -> int:
        """--grammar-fill-threads, or its default for this device and the cores this worker may
        run on (its affinity mask, split between the tensor-parallel ranks on this host)."""
        if self.args.grammar_fill_threads is not None:
            return self.args.grammar_fill_threads
        cores = len(os.sched_getaffinity(0)) // max(1, self.args.tp // self.args.nnodes)
        threads = auto_grammar_fill_threads(self.device.type, cores)
        logger.info("grammar masks: %d fill threads (%d cores)", threads, cores)
        return threads

    def _grammar_cache(self, source):
        """Constrained decoding's compile cache; None without xgrammar or without a tokenizer
        (a constrained request then fails with a clear error)."""
        try:
            from radix_runtime.grammar.compiler import GrammarCache
        except ImportError:
            logger.warning("xgrammar is not installed: constrained decoding is off")
            return None

        def load():
            from radix_runtime.tokenizer import load_tokenizer

            # the tokenizer the front uses (a dummy model without one: the default vocabulary)
            return load_tokenizer(self.args.tokenizer or source)

        return GrammarCache(
            load,
            self.config.vocab_size,
            list(self.config.eos_token_ids),
            threads=self.args.grammar_compile_threads,
        )

    def compile_grammar(self, kind: str, text: str) -> None:
        """Start compiling a grammar (the outcome comes from `finished_compiles`)."""
        if self.grammars is None:
            self._no_grammar.append(m.GrammarCompiled(kind=kind, text=text, error=NO_GRAMMAR))
            return
        self.grammars.submit(kind, text)

    def finished_compiles(self) -> list[m.GrammarCompiled]:
        out, self._no_grammar = self._no_grammar, []
        if self.grammars is not None:
            out += [
                m.GrammarCompiled(
                    kind=d.kind,
                    text=d.text,
                    error=d.error,
                    compile_s=d.compile_s,
                    cache_hit=d.cache_hit,
                )  # fmt: skip
                for d in self.grammars.take_finished()
            ]
        return out

    def compiles_pending(self) -> bool:
        return self.grammars is not None and self.grammars.pending() > 0

    def _backend_name(self) -> str:
        """auto: flashinfer on CUDA in bf16/fp16 (it has no float32 kernels), else torch."""
        name = resolve_backend_name(self.args.attention_backend, self.device)
        if self.args.attention_backend == "auto" and self.dtype == torch.float32:
            return "torch"
        return name

    def _fused_ops_available(self) -> bool:
        """The fused CUDA kernels (worker/kernels) need a GPU, bf16/fp16, Triton and FlashInfer."""
        if self.device.type != "cuda" or self.dtype == torch.float32:
            return False
        return kernels_available()

    def use_kernels(self, kernels: KernelConfig) -> None:
        """Run the CUDA path with `kernels` from now on (the model's fused ops and the attention
        backend's choices). CUDA graphs captured before keep the kernels they captured: a
        benchmark that switches recaptures them."""
        from radix_runtime.worker.kernels.ops import FusedOps

        self.kernels = kernels
        self.attn.kernels = kernels
        self.model.enable_fused_ops(FusedOps(kernels))

    def _allocate_kv_pool(self) -> KVPool:
        c, args = self.config, self.args
        kv_dtype = kv_storage_dtype(args.kv_cache_dtype, self.dtype)
        per_token = KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, kv_dtype)
        num_pages = num_pages_for(
            args.max_total_tokens, self.page_size, self.device, per_token, args.mem_fraction_static
        )
        # NOTE: a page id names the same slot on every rank, so all ranks hold the same count
        num_pages = self.tp.min_over_ranks(num_pages, self.device)
        logger.info(
            "KV pool: %d pages, %.2f GiB", num_pages, num_pages * self.page_size * per_token / 2**30
        )
        return KVPool(
            c.num_layers,
            num_pages,
            self.page_size,
            c.num_kv_heads,
            c.head_dim,
            kv_dtype,
            self.device,
            act_dtype=self.dtype,
            kv_scales=self.kv_scales if kv_dtype != self.dtype else None,
        )

    def _allocate_host_pool(self) -> HostKVPool:
        c, args = self.config, self.args
        per_token = KVPool.bytes_per_token(
            c.num_layers, c.num_kv_heads, c.head_dim, self.kv_pool.dtype
        )
        pages = host_pool_pages(self.kv_pool, args.hicache_size, args.hicache_ratio, per_token)
        pool = HostKVPool(self.kv_pool, pages)
        self.load_bandwidth = measure_load_bandwidth(self.device)
        logger.info(
            "host KV tier: %d pages, %.2f GiB%s; load bandwidth %.1f GB/s",
            pages, pool.nbytes / 2**30, " pinned" if pool.cuda else "", self.load_bandwidth / 1e9,
        )  # fmt: skip
        return pool

    def ready_info(self) -> m.WorkerReady:
        c = self.config
        return m.WorkerReady(
            host_num_pages=self.host_pool.num_pages if self.host_pool is not None else 0,
            kv_bytes_per_token=KVPool.bytes_per_token(
                c.num_layers, c.num_kv_heads, c.head_dim, self.kv_pool.dtype
            ),
            load_bandwidth=self.load_bandwidth,
            num_pages=self.kv_pool.num_pages,
            page_size=self.page_size,
            context_length=self.context_length,
            vocab_size=self.config.vocab_size,
            eos_token_ids=list(self.config.eos_token_ids),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.attn.name,
            kv_cache_dtype=self.kv_pool.kv_cache_dtype,
            quantization=self.quantization,
            max_running_requests=self.max_running,
        )

    def forward(self, batch: m.ForwardBatch) -> m.ForwardResult:
        return self.collect(self.launch(batch))

    def forward_with_logits(
        self, batch: m.ForwardBatch
    ) -> tuple[m.ForwardResult, list[torch.Tensor | None]]:
        """The step, plus each request's float32 logits rows (for tests; None where none were computed)."""
        pending = self.launch(batch, keep_logits=True)
        return self.collect(pending), pending.logits or []

    @torch.inference_mode()
    def launch(
        self, batch: m.ForwardBatch, keep_logits: bool = False, defer_sample: bool = False
    ) -> PendingStep:
        """Prepare the step on the host and enqueue all of its device work (model, sampling, the
        copies of the results to the host); nothing waits for the device. With `defer_sample`
        and a constrained row in the batch, only the model: `sample(pending)` queues the rest."""
        t0 = time.perf_counter()
        if self._deferred is not None:  # the step before samples first (stream order)
            self.sample(self._deferred)
        for slot in batch.released_slots:
            self.sampler.release(slot)
        pending = PendingStep(step=batch.step, reqs=batch.reqs, t0=t0)
        if batch.write_src or batch.load_src or self.host_pool is not None:
            # NOTE: with a host tier every step goes through it, copies or not: it also waits
            # for the previous batch's writes (their device pages may be reused now)
            pending.load = self._host_copies(batch)
        layout = self._prepare(batch.reqs) if batch.reqs else None
        if layout is not None and self.host_pool is not None and self.device.type == "cuda":
            # the loads held for later steps (prefetches) into pages this step touches
            held = self.host_pool.wait_pending(layout.pages)
            if held is not None:  # timed with the copies sent on their own
                self._early.append(held)
        pending.early, self._early = self._early, []
        if layout is None:
            return pending
        if self.threads:
            self._cpu_threads_for(layout.meta.num_tokens, len(batch.reqs))
        self._in_flight[pending.step] = layout.pages
        logits = self._logits(layout, keep_logits)
        pending.deferred = (layout, logits, keep_logits)
        if not (
            defer_sample and self.sampler.has_grammar([r.slot for r in batch.reqs if r.sample])
        ):
            self.sample(pending)
        else:
            self._deferred = pending
        return pending

    def _cpu_threads_for(self, tokens: int, requests: int) -> None:
        """Intra-op threads of a CPU step's layers: --cpu-small-step-threads (default: all) for a
        batch-1/2 decode step and for a lone request's chunk of at most SMALL_CHUNK_TOKENS (a
        cached turn); all of them for anything larger (and for every step's LM head)."""
        small = tokens <= SMALL_STEP_TOKENS or (requests == 1 and tokens <= SMALL_CHUNK_TOKENS)
        self._set_cpu_threads(self.small_step_threads if small else self.threads)

    @staticmethod
    def _set_cpu_threads(n: int) -> None:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    @torch.inference_mode()
    def sample(self, pending: PendingStep) -> None:
        """Queue the sampling of a launched step and the copies of its results to the host (a
        no-op once done)."""
        if pending.deferred is None:
            return
        layout, logits, keep_logits = pending.deferred
        pending.deferred = None
        if self._deferred is pending:
            self._deferred = None
        reqs = pending.reqs
        per_req = [logits[a:b] if b > a else None for a, b in layout.logit_ranges]
        fetch: list[torch.Tensor] = []
        sampled = [i for i, r in enumerate(reqs) if r.sample]
        if sampled:
            last_rows = [layout.logit_ranges[i][1] - 1 for i in sampled]
            rows = logits
            if len(last_rows) < len(logits):  # prompt-logprob rows in between
                rows = logits[to_device(last_rows, torch.long, self.device)]
            slots = [reqs[i].slot for i in sampled]
            out = self.sampler.sample_on_device(
                rows,
                slots,
                [reqs[i].return_logprob for i in sampled],
                [reqs[i].top_logprobs_num for i in sampled],
            )
            # every rank sampled the same logits alike; rank 0's ids make sure all feed them
            self.tp.broadcast_from_first(out.next_ids)
            self.last_sampled[to_device(slots, torch.long, self.device)] = out.next_ids
            pending.sample, pending.sampled = out, sampled
            fetch.extend(out.tensors())
        pending.prompt_rows = [i for i, r in enumerate(reqs) if r.prompt_logprobs]
        for i in pending.prompt_rows:
            fetch.extend(self._prompt_logprobs(reqs[i], layout.ids[i], per_req[i]))
        pending.host, pending.event = self._copy_to_host(fetch)
        if sampled:  # host[0]: the sampled ids (a grammar accepts its token from there)
            self.sampler.note_sampled(slots, pending.step, pending.host[0], pending.event)
        if keep_logits:
            pending.logits = per_req

    def _host_copies(self, batch: m.ForwardBatch):
        """The host tier's copies of this batch, queued before its model (HostKVPool.copy), as
        soon as the batch arrives. The step waits for the loads into the pages its rows are
        handed (`new_pages`: a page loaded now is fresh, so only a request admitted with it
        reads it); the others are held for later steps (`HostKVPool.wait_pending`)."""
        empty = np.zeros(0, np.int32)
        needs = np.concatenate([empty, *(m.unpack_ids(r.new_pages) for r in batch.reqs)])
        return self._queue_host_copies(batch, needs)

    def _queue_host_copies(self, msg: m.ForwardBatch | m.HostCopies, needs: np.ndarray):
        """`msg`'s host-tier copies on the copy stream, beside the steps in flight; the loads
        into `needs` are the ones the next launched step waits for."""
        if self.host_pool is None:
            raise ValueError(
                "host-tier copies sent to a worker without --enable-hierarchical-cache"
            )
        return self.host_pool.copy(
            m.unpack_ids(msg.write_src),
            m.unpack_ids(msg.write_dst),
            m.unpack_ids(msg.load_src),
            m.unpack_ids(msg.load_dst),
            msg.writes_block,
            busy=self.pages_in_flight(),
            needs=needs,
        )

    @torch.inference_mode()
    def early_copies(self, msg: m.HostCopies) -> None:
        """Host-tier copies sent on their own (--hicache-prefetch arrival), made now: queued on
        the copy stream beside the steps in flight (a load waits for them only if it touches
        their pages), and every step launched later waits for them, as for a batch's copies.
        Their times are reported with the next step launched."""
        # no step of their own: each later step waits for the pages it touches
        self._early.append(self._queue_host_copies(msg, np.zeros(0, np.int32)))

    def pages_in_flight(self) -> StepPages:
        """The KV pages the launched, not yet collected steps read and write."""
        steps = list(self._in_flight.values())
        if len(steps) == 1:
            return steps[0]
        empty = np.zeros(0, np.int32)
        return StepPages(
            read=np.concatenate([empty, *(s.read for s in steps)]),
            written=np.concatenate([empty, *(s.written for s in steps)]),
        )

    def collect(self, pending: PendingStep) -> m.ForwardResult:
        """Wait for a launched step and pack its result."""
        self.sample(pending)
        if pending.event is not None:
            pending.event.synchronize()
        self._in_flight.pop(pending.step, None)  # its kernels are done (the event follows them)
        # the copies' times: this batch's and those sent on their own before it; a time whose
        # copy is still running (a load held for a later step) is read with a later step
        copies = [t for t in (pending.load, *pending.early) if t is not None]
        issue_s = sum(t.issue_s for t in copies)
        load_waited = any(t.load_waited for t in copies)
        write_waited = any(t.write_waited for t in copies)
        load_s = wait_s = 0.0
        unread, self._unread = self._unread + copies, []
        for t in unread:
            if not t.ready():
                self._unread.append(t)
                continue
            took = HostKVPool.load_time(t)
            load_s += took
            wait_s += HostKVPool.wait_time(t)
            if t.load_bytes and took > 0 and logger.isEnabledFor(logging.DEBUG):
                logger.debug(
                    "host load: %.1f MB in %.3f ms (%.1f GB/s)",
                    t.load_bytes / 1e6, took * 1e3, t.load_bytes / took / 1e9,
                )  # fmt: skip
        results = [m.ForwardReqResult() for _ in pending.reqs]
        host = pending.host or []
        used = 0
        if pending.sample is not None:
            used = len(pending.sample.tensors())
            out = pending.sample.to_host(host[:used])
            self.sampler.resolve_step([pending.reqs[i].slot for i in pending.sampled], pending.step)
            for j, i in enumerate(pending.sampled):
                res = results[i]
                res.next_id = out.next_ids[j]
                req = pending.reqs[i]
                # no jump-forward for logprob requests: forced tokens have no model logprob
                jump = not req.return_logprob and req.top_logprobs_num == 0
                done, error, replaced, forced = self.sampler.grammar_status(
                    req.slot, pending.step, jump
                )
                res.grammar_done, res.grammar_error = done, error
                if replaced is not None:  # jump-forward re-tokenized the boundary
                    res.next_id = replaced
                if forced:
                    res.jump_ids = m.pack_ids(forced)
                res.logprob = out.logprobs[j]
                if pending.reqs[i].top_logprobs_num > 0:
                    res.top_ids = m.pack_ids(out.top_ids[j])
                    res.top_logprobs = m.pack_floats(out.top_logprobs[j])
        for i in pending.prompt_rows or []:
            lps = host[used]
            results[i].prompt_logprobs = m.pack_floats(lps.numpy().astype(np.float32))
            used += 1
            if pending.reqs[i].top_logprobs_num > 0:  # and the top-k of each position
                top_vals, top_idx = host[used], host[used + 1]
                results[i].prompt_top_logprobs = m.pack_floats(top_vals.numpy().reshape(-1))
                results[i].prompt_top_ids = m.pack_ids(top_idx.numpy().reshape(-1))
                used += 2
        forward_s = time.perf_counter() - pending.t0
        return m.ForwardResult(
            step=pending.step,
            results=results,
            forward_s=forward_s,
            load_s=load_s,
            copy_wait_s=wait_s,
            copy_issue_s=issue_s,
            load_waited=load_waited,
            write_waited=write_waited,
        )

    def _copy_to_host(
        self, tensors: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Queue copies of `tensors` into pinned host memory and an event after them (on the
        CPU the tensors already are host tensors)."""
        if self.device.type != "cuda":
            return [t.detach() for t in tensors], None
        host = []
        for t in tensors:
            h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            h.copy_(t, non_blocking=True)
            host.append(h)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _logits(self, layout: _StepLayout, keep: bool) -> torch.Tensor:
        """float32 logits of `layout.logit_rows`: a CUDA graph replay for decode-only batches
        that fit one, or for prefill/mixed batches that fit a captured shape and want no prompt
        logprobs (a graph's output buffer is reused by the next replay: `keep` copies it out),
        else plan + an eager forward."""
        meta = layout.meta
        logits = None
        # the graphs read the token ids from the device tensor: from_last_sample rows are only
        # known there (meta.input_ids_cpu holds 0 for them)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            logits = self.cuda_graphs.replay(meta, layout.input_ids)
        elif self.extend_graphs is not None and all(b - a <= 1 for a, b in layout.logit_ranges):
            # None when no captured shape holds the step
            logits = self.extend_graphs.replay(meta, layout.input_ids)
        if logits is not None:  # one row per request, its last
            if len(layout.logit_rows) < meta.batch_size:  # some chunk samples nothing
                wanted = [i for i, (a, b) in enumerate(layout.logit_ranges) if b > a]
                return logits[to_device(wanted, torch.long, self.device)]
            return logits.clone() if keep else logits
        self.attn.plan(meta)
        hidden = self.model(layout.input_ids, meta.positions, self.attn, self.kv_pool)
        rows = to_device(layout.logit_rows, torch.long, self.device)
        if self.threads:  # the LM head is one large matmul: all threads, whatever the step
            self._set_cpu_threads(self.threads)
        return self.model.compute_logits(hidden[rows])

    # ------------------------------------------------------------------------------------------
    # step preparation

    def _prepare(self, reqs: list[m.ForwardReq]) -> _StepLayout:
        # from_last_sample rows: one placeholder token (0) here, the real one gathered below
        ids = [_PLACEHOLDER if r.from_last_sample else m.unpack_ids(r.input_ids) for r in reqs]
        if len({r.slot for r in reqs}) != len(reqs):
            raise ValueError("a batch holds the same slot twice")
        for r, req_ids in zip(reqs, ids):
            self._admit(r, len(req_ids))
        qo_lens = np.array([len(x) for x in ids], dtype=np.int32)
        prefix_lens = np.array([r.start_pos for r in reqs], dtype=np.int32)
        seq_lens = prefix_lens + qo_lens
        num_pages = -(-seq_lens // self.page_size)
        page_rows = [self.req_to_page[r.slot, :n] for r, n in zip(reqs, num_pages)]
        for r, row in zip(reqs, page_rows):
            if not row.all():  # 0 = never sent: K/V would land in the reserved page
                raise ValueError(f"slot {r.slot}: no page for some of its first {len(row)} pages")
        positions = np.concatenate([np.arange(p, s) for p, s in zip(prefix_lens, seq_lens)])
        # the page of each new token, looked up in its own request's page row
        token_pages = np.concatenate(
            [
                row[np.arange(p, s) // self.page_size]
                for row, p, s in zip(page_rows, prefix_lens, seq_lens)
            ]
        )
        out_cache_loc = token_pages.astype(np.int64) * self.page_size + positions % self.page_size
        input_ids_cpu = np.concatenate(ids).astype(np.int64)
        meta = self._metadata(
            qo_lens, prefix_lens, seq_lens, num_pages, page_rows, input_ids_cpu, positions,
            out_cache_loc,
        )  # fmt: skip
        input_ids = to_device(input_ids_cpu, torch.long, self.device)
        from_last = [i for i, r in enumerate(reqs) if r.from_last_sample]
        if from_last:  # the tokens these slots sampled last, never leaving the device
            index = to_device(
                [meta.qo_indptr_cpu[from_last], [reqs[i].slot for i in from_last]],
                torch.long,
                self.device,
            )
            input_ids[index[0]] = self.last_sampled[index[1]]
        self._observe_fed(reqs, input_ids, meta.qo_indptr_cpu)
        logit_rows, logit_ranges = self._logit_rows(reqs, meta.qo_indptr_cpu)
        # the arrays the metadata built anyway (fresh copies: later steps' slot resets do not
        # change them)
        pages = StepPages(read=meta.kv_page_indices_cpu, written=token_pages)
        return _StepLayout(input_ids, meta, ids, logit_rows, logit_ranges, pages)

    def _admit(self, r: m.ForwardReq, n_new: int) -> None:
        """Validate one request's share and apply its new pages / new-slot reset."""
        if not 0 <= r.slot < self.req_to_page.shape[0]:
            raise ValueError(f"slot {r.slot} is outside [0, {self.req_to_page.shape[0]})")
        if n_new == 0:
            raise ValueError(f"slot {r.slot}: a forward request needs at least one input token")
        if r.from_last_sample and r.input_ids:
            raise ValueError(f"slot {r.slot}: from_last_sample with input_ids")
        if r.start_pos + n_new > self.context_length:
            raise ValueError(
                f"slot {r.slot}: {r.start_pos + n_new} tokens exceed the context length"
            )
        if r.new_slot:
            self.req_to_page[r.slot] = 0
            self.sampler.reset_slot(
                r.slot,
                r.sampling or m.SamplingParams(),
                history=m.unpack_ids(r.history_ids),
                prior_outputs=m.unpack_ids(r.prior_output_ids),
            )
        elif r.slot not in self.sampler.slots:
            raise ValueError(f"slot {r.slot} was never opened with new_slot=True")
        if r.from_last_sample and not self.sampler.slots[r.slot].sampled:
            raise ValueError(f"slot {r.slot}: from_last_sample, but the slot has sampled nothing")
        pages = m.unpack_ids(r.new_pages)
        if len(pages):
            if pages.max() >= self.kv_pool.num_pages or pages.min() < 1:
                raise ValueError(f"slot {r.slot}: page ids outside [1, {self.kv_pool.num_pages})")
            end = r.page_offset + len(pages)
            if r.page_offset < 0 or end > self.max_pages_per_slot:
                raise ValueError(f"slot {r.slot}: pages [{r.page_offset}, {end}) overflow the row")
            self.req_to_page[r.slot, r.page_offset : end] = pages

    def _metadata(
        self,
        qo_lens: np.ndarray,
        prefix_lens: np.ndarray,
        seq_lens: np.ndarray,
        num_pages: np.ndarray,
        page_rows: list[np.ndarray],
        input_ids: np.ndarray,
        positions: np.ndarray,
        out_cache_loc: np.ndarray,
    ) -> AttentionMetadata:
        qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        kv_indptr = np.concatenate([[0], np.cumsum(num_pages)]).astype(np.int32)
        kv_page_indices = np.concatenate(page_rows).astype(np.int32)
        last_page_len = (seq_lens - (num_pages - 1) * self.page_size).astype(np.int32)

        # two host->device copies for the whole metadata instead of one per array
        qo_indptr_d, kv_indptr_d, indices_d, last_page_len_d, seq_lens_d = self._to_device(
            [qo_indptr, kv_indptr, kv_page_indices, last_page_len, seq_lens], np.int32
        )
        positions_d, out_cache_loc_d = self._to_device([positions, out_cache_loc], np.int64)
        return AttentionMetadata(
            page_size=self.page_size,
            num_tokens=int(qo_indptr[-1]),
            qo_indptr_cpu=qo_indptr,
            kv_indptr_cpu=kv_indptr,
            kv_page_indices_cpu=kv_page_indices,
            kv_last_page_len_cpu=last_page_len,
            prefix_lens_cpu=prefix_lens,
            seq_lens_cpu=seq_lens.astype(np.int32),
            input_ids_cpu=input_ids,
            positions_cpu=positions.astype(np.int64, copy=False),
            out_cache_loc_cpu=out_cache_loc,
            qo_indptr=qo_indptr_d,
            kv_indptr=kv_indptr_d,
            kv_page_indices=indices_d,
            kv_last_page_len=last_page_len_d,
            seq_lens=seq_lens_d,
            positions=positions_d,
            out_cache_loc=out_cache_loc_d,
        )

    def _to_device(self, arrays: list[np.ndarray], dtype: type) -> list[torch.Tensor]:
        """One copy of the concatenated arrays; returns contiguous views, one per array."""
        flat = np.concatenate(arrays).astype(dtype, copy=False)
        torch_dtype = torch.int32 if dtype is np.int32 else torch.long
        device = to_device(torch.from_numpy(flat), torch_dtype, self.device)
        return list(device.split([len(a) for a in arrays]))

    def _observe_fed(
        self, reqs: list[m.ForwardReq], input_ids: torch.Tensor, qo_indptr: np.ndarray
    ) -> None:
        for i, r in enumerate(reqs):
            self.sampler.observe_fed(r.slot, input_ids[qo_indptr[i] : qo_indptr[i + 1]])

    @staticmethod
    def _logit_rows(
        reqs: list[m.ForwardReq], qo_indptr: np.ndarray
    ) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """All rows for prompt logprobs, the last row for sampling, none otherwise."""
        chunks, ranges, at = [], [], 0
        for i, r in enumerate(reqs):
            start, end = int(qo_indptr[i]), int(qo_indptr[i + 1])
            if r.prompt_logprobs:
                rows = np.arange(start, end)
            else:
                rows = np.arange(end - 1, end) if r.sample else np.arange(0)
            chunks.append(rows)
            ranges.append((at, at + len(rows)))
            at += len(rows)
        return np.concatenate(chunks).astype(np.int64), ranges

    # ------------------------------------------------------------------------------------------
    # results

    def _prompt_logprobs(
        self, r: m.ForwardReq, ids: np.ndarray, logits: torch.Tensor
    ) -> list[torch.Tensor]:
        """[logprob of input_ids[1:] (and next_token when known), each given everything before
        it], and with r.top_logprobs_num = k > 0 also the top-k logprobs and ids of each of those
        positions ([n, k] float32 and int32) (on the device)."""
        targets = ids[1:].astype(np.int64)
        if r.next_token >= 0:
            targets = np.append(targets, r.next_token)
        k = r.top_logprobs_num
        if len(targets) == 0:
            empty = torch.zeros(0, dtype=torch.float32, device=self.device)
            return [empty] if k <= 0 else [empty, empty.view(0, k), empty.view(0, k).int()]
        t = to_device(targets, torch.long, self.device)
        rows = logits[: len(targets)]
        out = [target_logprobs(rows, t).float()]
        if k > 0:
            top = torch.log_softmax(rows.float(), dim=-1).topk(k, dim=-1)
            out += [top.values, top.indices.int()]
        return out
