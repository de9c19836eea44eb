"""The GPU worker on its own: decode and prefill speed of the ModelRunner against the machine's
ceilings, measured in the same run.

Drives `ModelRunner.forward` in-process with real ForwardBatch messages (no server, no
scheduler): Llama-3.1-8B shape, bf16, dummy weights by default. Reports
- ceilings: `copy_TBps` (device-to-device copy, bytes read + written), `read_TBps` (the LM-head
  GEMV streaming distinct weights in one CUDA graph: the best read rate bench/gemv_sweep.py
  finds), `matmul_TFLOPs` (8192^3 bf16 on random data), and the device's spec where known
  (`spec_TBps`, `spec_TFLOPs`: the H200's 4.8 TB/s and 989 dense bf16 TFLOP/s);
- decode at batch 1 / 64 / 256 over 1,024-token contexts (the pool pages are filled with random
  K/V rather than prefilled: attention reads the same bytes either way). Batch 1 is compared with
  the roofline: weight bytes read per step / step time / ceiling, against each bandwidth ceiling
  (`decode_bs1_roofline_fraction` divides by the copy bandwidth, the definition the goal was set
  on; `_read_bw_fraction` by `read_TBps`; `_spec_fraction` by the spec);
- prefill of 8,192 tokens in one chunk, as MFU: model FLOPs / time / matmul ceiling
  (`prefill_8192_mfu`; `prefill_8192_mfu_spec` against the spec);
- cached TTFT: the same 8,192-token prompt with its first 7,936 tokens already in the pool;
- large decode steps (`--large-decodes`, default 256 and 512 requests at 1,536 tokens of
  context): step time / bandwidth roofline (weights once + every request's KV at the copy
  bandwidth; `decode_bs512_ctx1536_roofline_ratio`, goal <= 1.15), graph vs eager, the host's
  batch preparation and attention planning, and the GPU time by phase (matmul, attention, KV
  store, sampling, ...; `--trace-dir` also writes Chrome traces).
Decode step times are host wall-clock per step as the worker runs them (`decode_bsN_ms`: the
overlap schedule, step N+1 launched before step N is collected, so the host work of one step hides
behind the GPU's work on the other) and one step at a time (`decode_bsN_sync_ms`: `forward`, which
synchronizes); both include planning, copies and sampling: what a server step costs.

    python bench/gpu_worker.py --out docs/results/h200_gpu_worker.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ceilings import copy_TBps, cuda_time_ms, matmul_TFLOPs, wall_time_ms
from bench.common import provenance, safe_token_range
from bench.kernel_phases import phase_breakdown
from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.worker.cuda_graph import CudaGraphRunner
from radix_runtime.worker.kernels import gemv
from radix_runtime.worker.model_runner import ModelRunner

GREEDY = m.SamplingParams(temperature=0.0, max_new_tokens=1 << 20)

# device name -> (HBM bandwidth TB/s, dense bf16 TFLOP/s) from the vendor's data sheet
SPECS = {"NVIDIA H200": (4.8, 989.0)}


def ceilings() -> dict:
    cuda = torch.device("cuda")
    spec_bw, spec_flops = SPECS.get(torch.cuda.get_device_name(), (None, None))
    return {
        "copy_TBps": copy_TBps(cuda),  # 2 GiB of bf16 each way: far beyond the 60 MB L2
        "read_TBps": read_bandwidth_TBps(),
        "matmul_TFLOPs": matmul_TFLOPs(cuda, torch.bfloat16),
        "spec_TBps": spec_bw,
        "spec_TFLOPs": spec_flops,
    }


def read_bandwidth_TBps(rows: int = 128256, cols: int = 4096, copies: int = 4) -> float:
    """Weight bytes per second of the batch-1 GEMV on the LM head's shape, over `copies`
    distinct weights (2 GB, far beyond L2) replayed in one CUDA graph: the fastest streaming
    read this code reaches on the device (bench/gemv_sweep.py times the same way)."""
    from bench.gemv_sweep import graph_us

    ws = [torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, cols, device="cuda", dtype=torch.bfloat16)
    us = graph_us([lambda w=w: gemv.gemv(x, w) for w in ws])
    del ws
    torch.cuda.empty_cache()
    return rows * cols * 2 / us / 1e6


class Bench:
    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.next_page = 1
        self.step_no = 0
        self.rng = np.random.default_rng(seed)
        self.vocab = runner.config.vocab_size
        self.last_decode_pos = 0  # slot 0's position after the last decode() run
        self.last_hit = None  # the last cached_prefill()'s cached request, as a callable

    def pages(self, n: int) -> list[int]:
        assert self.next_page + n <= self.runner.kv_pool.num_pages, "pool too small"
        out = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return out

    def ids(self, n: int) -> list[int]:
        lo, hi = safe_token_range(self.vocab)
        return [int(x) for x in self.rng.integers(lo, hi, size=n)]

    def forward(self, reqs: list[m.ForwardReq]) -> m.ForwardResult:
        self.step_no += 1
        return self.runner.forward(m.ForwardBatch(step=self.step_no, reqs=reqs))

    def fill_random_kv(self, first_page: int, end_page: int) -> None:
        """Random K/V in pages [first_page, end_page) of every layer (never time on zeros)."""
        for buf in self.runner.kv_pool.k_buffers + self.runner.kv_pool.v_buffers:
            buf[first_page:end_page].normal_()

    # -----------------------------------------------------------------------------------------

    def _first_decodes(self, bs: int, ctx: int, tokens: int) -> list[m.ForwardReq]:
        """The first decode step of `bs` fresh slots whose contexts (random K/V) are `ctx` tokens,
        each with pages for `tokens` more."""
        per_req = -(-(ctx + tokens) // self.runner.page_size)
        self.next_page = 1
        rows = [self.pages(per_req) for _ in range(bs)]
        self.fill_random_kv(1, self.next_page)
        ids = self.ids(bs)
        return [
            m.ForwardReq(slot=i, input_ids=m.pack_ids([ids[i]]), start_pos=ctx,
                         new_pages=m.pack_ids(rows[i]), new_slot=True, sampling=GREEDY)
            for i in range(bs)
        ]  # fmt: skip

    def decode(self, bs: int, ctx: int, warmup: int = 5, iters: int = 30) -> float:
        """Median ms of a decode step of `bs` requests whose contexts start at `ctx` tokens."""
        steps = warmup + iters
        reqs = self._first_decodes(bs, ctx, steps + 1)
        times = []
        for step in range(steps):
            t0 = time.perf_counter()
            result = self.forward(reqs)
            times.append((time.perf_counter() - t0) * 1e3)
            reqs = [
                m.ForwardReq(slot=i, input_ids=m.pack_ids([r.next_id]), start_pos=ctx + step + 1)
                for i, r in enumerate(result.results)
            ]
            self.last_decode_pos = ctx + step + 1
        return statistics.median(times[warmup:])

    def decode_overlapped(self, bs: int, ctx: int, warmup: int = 5, iters: int = 30) -> float:
        """Median ms per decode step of `bs` requests as the worker runs them with the overlap
        schedule: step N+1 is launched (its inputs the tokens step N samples, on the device)
        before step N's results are collected, so the host work of one step runs while the GPU
        runs the other. Time per step = wall time between consecutive collects."""
        steps = warmup + iters
        first = self._first_decodes(bs, ctx, steps + 2)
        self.step_no += 1
        pending = self.runner.launch(m.ForwardBatch(step=self.step_no, reqs=first))
        times, t_prev = [], time.perf_counter()
        for step in range(steps):
            self.step_no += 1
            reqs = [
                m.ForwardReq(slot=i, input_ids=b"", start_pos=ctx + step + 1, from_last_sample=True)
                for i in range(bs)
            ]
            nxt = self.runner.launch(m.ForwardBatch(step=self.step_no, reqs=reqs))
            self.runner.collect(pending)
            now = time.perf_counter()
            times.append((now - t_prev) * 1e3)
            t_prev, pending = now, nxt
        self.runner.collect(pending)
        self.last_decode_pos = ctx + steps + 1
        return statistics.median(times[warmup:])

    def prefill(self, n: int, warmup: int = 1, iters: int = 5) -> float:
        prompt = m.pack_ids(self.ids(n))
        self.next_page = 1
        pages = m.pack_ids(self.pages(-(-n // self.runner.page_size)))
        req = m.ForwardReq(
            slot=0, input_ids=prompt, start_pos=0, new_pages=pages, new_slot=True, sampling=GREEDY
        )
        return wall_time_ms(lambda: self.forward([req]), warmup, iters)

    def cached_prefill(
        self, n: int, cached: int, warmup: int = 2, iters: int = 10
    ) -> tuple[float, float]:
        """(cold ms, cached ms) of the same n-token prompt, the second with `cached` tokens of it
        in the pool from an earlier request (page-aligned)."""
        ps = self.runner.page_size
        assert cached % ps == 0
        prompt = self.ids(n)
        self.next_page = 1
        shared = self.pages(cached // ps)
        own = self.pages(-(-(n - cached) // ps))
        first = m.ForwardReq(
            slot=1,
            input_ids=m.pack_ids(prompt[:cached]),
            start_pos=0,
            new_pages=m.pack_ids(shared),
            new_slot=True,
            sample=False,
            sampling=GREEDY,
        )
        self.forward([first])  # the prefix's KV now sits in `shared`
        hit = m.ForwardReq(
            slot=2,
            input_ids=m.pack_ids(prompt[cached:]),
            start_pos=cached,
            new_pages=m.pack_ids(shared + own),
            new_slot=True,
            sampling=GREEDY,
        )
        cold_pages = self.pages(-(-n // ps))
        cold = m.ForwardReq(
            slot=3,
            input_ids=m.pack_ids(prompt),
            start_pos=0,
            new_pages=m.pack_ids(cold_pages),
            new_slot=True,
            sampling=GREEDY,
        )
        self.last_hit = lambda: self.forward([hit])
        return (
            wall_time_ms(lambda: self.forward([cold]), 1, 5),
            wall_time_ms(lambda: self.forward([hit]), warmup, iters),
        )

    def prepare_ms(self, iters: int = 50) -> float:
        """Host time of the runner's batch preparation for the last decode batch (slot 0)."""
        req = m.ForwardReq(slot=0, input_ids=m.pack_ids([5]), start_pos=self.last_decode_pos)
        return wall_time_ms(lambda: self.runner._prepare([req]), 5, iters)


def profiled(fn, steps: int, cpu: bool = False):
    """`steps` calls of fn under torch.profiler (CUDA activity; `cpu`: CPU activity too), until
    the device is done: the profile (warm fn up first)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] if cpu else []
    with profile(activities=[*activities, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return prof


def kernel_profile(fn, steps: int, top: int = 14, trace: str | None = None) -> dict:
    """GPU kernels of `steps` calls of fn (torch.profiler, CUDA activity only; with `trace`, CPU
    activity too, written there as a Chrome trace): the time per call by kernel name, largest
    first, the time per phase of the step (bench/kernel_phases.py), plus totals."""
    fn()
    torch.cuda.synchronize()
    if trace:  # a profile of its own: CPU events would count their kernels' time again below
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        profiled(fn, steps, cpu=True).export_chrome_trace(trace)
    prof = profiled(fn, steps)
    kernels = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            kernels.append((t / steps, e.count / steps, e.key[:100]))
    kernels.sort(reverse=True)
    return {
        "gpu_us_per_call": sum(k[0] for k in kernels),
        "kernels_per_call": sum(k[1] for k in kernels),
        "phases_us": phase_breakdown([{"us": t, "name": n} for t, _, n in kernels]),
        "top": [{"us": t, "calls": c, "name": n} for t, c, n in kernels[:top]],
    }


def bandwidth_fractions(key: str, w_bytes: int, ms: float, ceilings: dict) -> dict:
    """The weight stream of a step of `ms` as TB/s and as a fraction of each bandwidth ceiling:
    `{key}_roofline_fraction` (the copy bandwidth), `{key}_read_bw_fraction` (`read_TBps`) and
    `{key}_spec_fraction` (`spec_TBps`, when the device's spec is known)."""
    tbps = w_bytes / (ms * 1e-3) / 1e12
    out = {
        f"{key}_TBps": tbps,
        f"{key}_roofline_fraction": tbps / ceilings["copy_TBps"],
        f"{key}_read_bw_fraction": tbps / ceilings["read_TBps"],
    }
    if ceilings.get("spec_TBps"):
        out[f"{key}_spec_fraction"] = tbps / ceilings["spec_TBps"]
    return out


def weight_bytes_per_decode_step(runner: ModelRunner) -> int:
    """Every parameter is read once per step, except the embedding table (one row per token)
    unless it doubles as the LM head."""
    total = 0
    for name, p in runner.model.named_parameters():
        if name == "model.embed_tokens.weight" and runner.model.lm_head is not None:
            continue
        total += p.numel() * p.element_size()
    return total


def prefill_flops(runner: ModelRunner, n: int, prefix: int = 0) -> float:
    """Matmul FLOPs of n new tokens after `prefix` cached ones: 2 per weight per token for the
    layers, the LM head on the last row only, and causal attention (QK^T and PV over the keys
    each query sees: on a sliding-window layer, at most its window)."""
    c = runner.config
    layer_weights = sum(
        p.numel() for name, p in runner.model.named_parameters() if ".layers." in name
    )
    positions = np.arange(prefix, prefix + n, dtype=np.float64)
    windows = c.layer_windows or (0,) * c.num_layers
    keys_seen = sum(
        float(np.minimum(positions + 1, w).sum()) if w else float((positions + 1).sum())
        for w in windows
    )
    attention = 4 * c.num_heads * c.head_dim * keys_seen
    return 2 * n * layer_weights + 2 * c.hidden_size * c.vocab_size + attention


def parse_large_decodes(text: str) -> list[tuple[int, int]]:
    """ "256x1536,512x1536" -> [(256, 1536), (512, 1536)] (batch x context)."""
    out = []
    for part in text.split(","):
        if part.strip():
            bs, ctx = part.lower().split("x")
            out.append((int(bs), int(ctx)))
    return out


def large_decode(
    bench: Bench, bs: int, ctx: int, w_bytes: int, kv_per_token: int, copy_bps: float,
    trace_dir: str | None = None,
) -> dict:  # fmt: skip
    """A decode step of `bs` requests at `ctx` tokens of context against its bandwidth roofline
    (weights once + every request's KV, at the copy bandwidth), and where its time goes:
    - `_ms` (overlapped, as the server runs it), `_sync_ms` (one step alone), `_eager_ms` (one
      step alone without CUDA graphs), `_graph_replay_ms` (the graph's GPU time, when the batch
      fits one);
    - `_roofline_ms` and `_roofline_ratio` = step time / roofline time (the goal: <= 1.15);
    - host work of the step: `_host_prepare_ms` (the runner's batch layout and metadata) and
      `_host_plan_ms` (the attention backend's plan of the eager path);
    - GPU time per phase (`_profile_graph` / `_profile_eager`: kernels by phase, bench/kernel_phases.py),
      sampling and the KV store included."""
    runner = bench.runner
    key = f"decode_bs{bs}_ctx{ctx}"
    warmup, iters = 3, 15
    out: dict = {}
    ms = bench.decode_overlapped(bs, ctx, warmup, iters)
    # KV read by the middle step: every request's context, the token of the step included
    kv_bytes = bs * (ctx + 1 + warmup + iters // 2) * kv_per_token
    roof_ms = (w_bytes + kv_bytes) / copy_bps * 1e3
    out[f"{key}_kv_GB"] = kv_bytes / 1e9
    out[f"{key}_roofline_ms"] = roof_ms
    out[f"{key}_ms"] = ms
    out[f"{key}_roofline_ratio"] = ms / roof_ms
    out[f"{key}_tok_s"] = bs / (ms * 1e-3)
    out[f"{key}_sync_ms"] = bench.decode(bs, ctx, warmup, iters)
    # the same step again and again (each writes the same position: its pages are there)
    pos = bench.last_decode_pos
    reqs = [m.ForwardReq(slot=i, input_ids=m.pack_ids([5]), start_pos=pos) for i in range(bs)]

    def step() -> None:
        bench.forward(reqs)

    out[f"{key}_host_prepare_ms"] = wall_time_ms(lambda: runner._prepare(reqs), 3, 20)
    meta = runner._prepare(reqs).meta
    graphs = runner.cuda_graphs
    if graphs is not None and graphs.can_run(meta):
        step()  # the graph's wrapper planned for this batch
        padded = graphs.batch_sizes[bisect.bisect_left(graphs.batch_sizes, bs)]
        replay_ms = cuda_time_ms(graphs.graphs[padded].replay, 3, 20)
        out[f"{key}_graph_bs"] = padded
        out[f"{key}_graph_replay_ms"] = replay_ms
        out[f"{key}_graph_roofline_ratio"] = replay_ms / roof_ms
        trace = f"{trace_dir}/{key}_graph.json" if trace_dir else None
        out[f"{key}_profile_graph"] = kernel_profile(step, 3, trace=trace)
    else:
        out[f"{key}_graph_bs"] = None  # beyond --cuda-graph-max-bs: the step runs eager
    runner.cuda_graphs = None
    try:
        runner.attn.plan(meta)
        out[f"{key}_host_plan_ms"] = wall_time_ms(lambda: runner.attn.plan(meta), 3, 20)
        out[f"{key}_eager_ms"] = wall_time_ms(step, 2, 8)
        out[f"{key}_eager_roofline_ratio"] = out[f"{key}_eager_ms"] / roof_ms
        trace = f"{trace_dir}/{key}_eager.json" if trace_dir else None
        out[f"{key}_profile_eager"] = kernel_profile(step, 3, trace=trace)
    finally:
        runner.cuda_graphs = graphs
    return out


def host_profile(fn, calls: int, top: int = 25) -> str:
    import cProfile
    import io
    import pstats

    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def experiments(
    runner: ModelRunner, bench: Bench, results: dict, ctx: int, w_bytes: int, copy_bps: float
) -> None:
    """Diagnostics and variants, printed and stored under `experiments`."""
    exp: dict = {}
    bench.decode(1, ctx, 2, 3)
    pos = bench.last_decode_pos
    one = m.ForwardReq(slot=0, input_ids=m.pack_ids([5]), start_pos=pos)
    print("--- Python profile, 50 batch-1 decode steps (graph path)")
    print(host_profile(lambda: bench.forward([one]), 50))
    print("--- Python profile, 5 cached-prefix prefills (eager path)")
    print(host_profile(bench.last_hit, 5))
    graphs, wrapper = runner.cuda_graphs, runner.attn._graph_wrappers.get(1)
    variants = {  # (one-token fused path, Triton GEMVs, tensor-core attention)
        "cublas_all": (False, False, True),
        "cuda_core_attention": (True, True, False),
    }
    base = runner.kernels
    for name, (row_fusion, triton_gemv, tensor_cores) in variants.items():
        saved = runner.attn.tensor_cores
        runner.use_kernels(replace(base, row_fusion=row_fusion, triton_gemv=triton_gemv))
        runner.attn.tensor_cores = tensor_cores
        runner.attn._graph_wrappers.pop(1, None)
        runner.cuda_graphs = CudaGraphRunner(
            runner.model, runner.attn, runner.kv_pool, 1, runner.max_pages_per_slot, runner.device
        )
        step_ms = bench.decode_overlapped(1, ctx, 3, 20)
        replay_ms = cuda_time_ms(runner.cuda_graphs.graphs[1].replay, 3, 20)
        exp[name] = {"step_ms": step_ms, "graph_replay_ms": replay_ms}
        print(f"variant {name}: step {step_ms:.3f} ms, graph replay {replay_ms:.3f} ms")
        runner.use_kernels(base)
        runner.attn.tensor_cores = saved
        runner.attn._graph_wrappers.pop(1, None)
    runner.cuda_graphs = graphs  # the original graph with the wrapper it was captured with
    runner.attn._graph_wrappers[1] = wrapper
    results["experiments"] = exp


def prefill(runner: ModelRunner, bench: Bench, results: dict, args: argparse.Namespace) -> None:
    """Cold and cached prefill of --prefill-tokens, and a 2,048-token prefill, as MFU."""
    n, cached = args.prefill_tokens, args.cached_tokens
    cold_ms, hit_ms = bench.cached_prefill(n, cached)
    results["prefill_8192_ms" if n == 8192 else f"prefill_{n}_ms"] = cold_ms
    flops = prefill_flops(runner, n)
    results["prefill_tflops"] = flops / (cold_ms * 1e-3) / 1e12
    results["prefill_8192_mfu" if n == 8192 else f"prefill_{n}_mfu"] = (
        results["prefill_tflops"] / results["matmul_TFLOPs"]
    )
    if results["spec_TFLOPs"]:
        results["prefill_8192_mfu_spec" if n == 8192 else f"prefill_{n}_mfu_spec"] = (
            results["prefill_tflops"] / results["spec_TFLOPs"]
        )
    results["prefill_kernel"] = getattr(getattr(runner.attn, "_prefill", None), "_backend", None)
    results["cached_ttft_ms"] = hit_ms
    results["cached_ttft_profile"] = kernel_profile(bench.last_hit, 2)
    results["cached_ttft_speedup"] = cold_ms / hit_ms
    ext = runner.extend_graphs
    if ext is not None:  # the same cached prefill without the prefill graphs (eager)
        replays = ext.replays
        bench.last_hit()
        results["cached_ttft_graphed"] = ext.replays > replays
        results["extend_graph_capture_s"] = ext.capture_s
        runner.extend_graphs = None
        results["cached_ttft_eager_ms"] = wall_time_ms(bench.last_hit, 2, 10)
        results["cached_ttft_eager_speedup"] = cold_ms / results["cached_ttft_eager_ms"]
        runner.extend_graphs = ext
    results["cached_prefill_mfu"] = (
        prefill_flops(runner, n - cached, cached)
        / (hit_ms * 1e-3)
        / 1e12
        / results["matmul_TFLOPs"]
    )
    results["prefill_2048_ms"] = bench.prefill(2048, 1, 5)
    results["prefill_2048_mfu"] = (
        prefill_flops(runner, 2048) / (results["prefill_2048_ms"] * 1e-3) / 1e12
    ) / results["matmul_TFLOPs"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a dummy config name or path")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--cached-tokens", type=int, default=7936)
    p.add_argument("--decode-batches", default="1,64,256", help="'' for none")
    p.add_argument(
        "--large-decodes",
        type=parse_large_decodes,
        default=parse_large_decodes("256x1536,512x1536"),
        help="BATCHxCONTEXT decode steps measured against their bandwidth roofline with a "
        "phase breakdown ('' for none)",
    )
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill measurements")
    p.add_argument("--trace-dir", help="also write Chrome traces of the large decode steps here")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument(
        "--no-ab",
        action="store_true",
        help="skip the batch-1 A/B variants at the end (FlashInfer attention, unfused, cuBLAS)",
    )
    p.add_argument(
        "--experiments",
        action="store_true",
        help="also: Python profiles of a batch-1 step and a cached prefill, and batch-1 decode "
        "graphs with CUDA-core attention and with all-cuBLAS projections",
    )
    args = p.parse_args()

    results: dict = {"device": torch.cuda.get_device_name(), "model": args.model}
    results.update(ceilings())
    torch.cuda.empty_cache()
    batches = [int(b) for b in args.decode_batches.split(",") if b.strip()]
    largest = max(batches, default=1)
    pool_tokens = max(
        largest * (args.context + 64),
        *(bs * (ctx + 64) for bs, ctx in args.large_decodes),
        0 if args.no_prefill else 3 * args.prefill_tokens,
    )
    pool_tokens += 4096
    largest = max([largest, *(bs for bs, _ in args.large_decodes)])
    t0 = time.perf_counter()
    runner = ModelRunner(
        ServerArgs(
            model=args.model,
            load_format="dummy",
            page_size=args.page_size,
            context_length=max(16384, args.prefill_tokens + 1024),
            max_total_tokens=pool_tokens,
            max_running_requests=max(256, largest),
            cuda_graph_max_bs=largest,
        )
    )
    results.update(
        runner_init_s=time.perf_counter() - t0,
        dummy_weights_s=runner.load_s,
        cuda_graph_capture_s=runner.cuda_graphs.capture_s if runner.cuda_graphs else None,
        attention_backend=runner.attn.name,
        page_size=args.page_size,
        dtype=str(runner.dtype),
    )
    bench = Bench(runner)
    copy_bps = results["copy_TBps"] * 1e12
    w_bytes = weight_bytes_per_decode_step(runner)
    kv_per_token = runner.kv_pool.bytes_per_token(
        runner.config.num_layers, runner.config.num_kv_heads, runner.config.head_dim, runner.dtype
    )
    results["weight_GB_per_decode_step"] = w_bytes / 1e9

    for bs in batches:
        # the worker's schedule (overlapped steps, as the server runs them), and each step alone
        ms = bench.decode_overlapped(bs, args.context)
        results[f"decode_bs{bs}_sync_ms"] = bench.decode(bs, args.context)
        kv_bytes = bs * (args.context + 18) * kv_per_token  # mid-run context
        results[f"decode_bs{bs}_ms"] = ms
        results[f"decode_bs{bs}_tok_s"] = bs / (ms * 1e-3)
        results[f"decode_bs{bs}_bandwidth_fraction"] = (w_bytes + kv_bytes) / (ms * 1e-3) / copy_bps
        if bs == 1:
            results.update(bandwidth_fractions("decode_bs1", w_bytes, ms, results))
            if runner.cuda_graphs is not None:  # the GPU's share of the step, and graphs off
                graph_ms = cuda_time_ms(runner.cuda_graphs.graphs[1].replay, 3, 20)
                results["decode_bs1_graph_replay_ms"] = graph_ms
                results.update(bandwidth_fractions("decode_bs1_graph", w_bytes, graph_ms, results))
                results["decode_bs1_graph_profile"] = kernel_profile(
                    runner.cuda_graphs.graphs[1].replay, 5
                )
                results["decode_bs1_host_prepare_ms"] = bench.prepare_ms()
                graphs, runner.cuda_graphs = runner.cuda_graphs, None
                results["decode_bs1_eager_ms"] = bench.decode(1, args.context, 3, 10)
                runner.cuda_graphs = graphs

    for bs, ctx in args.large_decodes:
        results.update(
            large_decode(bench, bs, ctx, w_bytes, kv_per_token, copy_bps, args.trace_dir)
        )
    if not args.no_prefill:
        prefill(runner, bench, results, args)

    if args.experiments:
        experiments(runner, bench, results, args.context, w_bytes, copy_bps)
    if runner.cuda_graphs is not None and not args.no_ab and 1 in batches:
        # A/B in the same run: batch-1 decode with FlashInfer's decode attention instead of the
        # Triton split-KV kernel; also without the fused one-token path (the norms, adds and
        # SiLU as kernels of their own); and that with cuBLAS for every projection
        variants = (
            ("flashinfer_attention", True, True, 0),
            ("unfused", False, True, 0),
            ("cublas", False, False, 0),
        )
        base = runner.kernels
        for name, row_fusion, triton_gemv, triton_decode in variants:
            runner.use_kernels(
                replace(base, row_fusion=row_fusion, triton_gemv=triton_gemv,
                        triton_decode_max_bs=triton_decode)
            )  # fmt: skip
            runner.cuda_graphs = CudaGraphRunner(
                runner.model, runner.attn, runner.kv_pool, 1, runner.max_pages_per_slot,
                runner.device,
            )  # fmt: skip
            ms = bench.decode_overlapped(1, args.context)
            results[f"decode_bs1_{name}_ms"] = ms
            results[f"decode_bs1_{name}_roofline_fraction"] = w_bytes / (ms * 1e-3) / copy_bps
            graph_ms = cuda_time_ms(runner.cuda_graphs.graphs[1].replay, 3, 20)
            results[f"decode_bs1_{name}_graph_replay_ms"] = graph_ms
            results[f"decode_bs1_{name}_graph_profile"] = kernel_profile(
                runner.cuda_graphs.graphs[1].replay, 5
            )
        runner.use_kernels(base)

    if args.out:
        ceiling = {
            k: results[k]
            for k in ("copy_TBps", "read_TBps", "matmul_TFLOPs", "spec_TBps", "spec_TFLOPs")
        }
        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(ceiling), **results}, f, indent=2)
    width = max(len(k) for k in results)
    for k, v in results.items():
        if isinstance(v, dict) and "top" in v:  # kernel profiles
            print(f"{k}: {v['gpu_us_per_call']:.1f} us GPU, {v['kernels_per_call']:.0f} kernels")
            phases = ", ".join(f"{name} {us:.0f}" for name, us in v["phases_us"].items())
            print(f"    by phase (us): {phases}")
            for row in v["top"]:
                print(f"    {row['us']:9.1f} us  x{row['calls']:<5.0f} {row['name']}")
        else:
            print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
