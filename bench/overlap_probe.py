"""Can a large decode step's attention run beside its matmuls? A probe on one GPU.

A decode step of 512 requests at ~1.5K context (Llama-3.1-8B shape, bf16) is two kinds of work,
each at its own ceiling when it runs alone: attention reads every request's KV (bandwidth-bound,
tensor cores idle) and the layer's projections are GEMMs of 512 rows (compute-bound). Run one
after the other, the step is their sum. Nano-batching (NanoFlow) splits the batch in two halves
and runs one half's attention beside the other half's GEMMs on a second stream, layer by layer.
This probe measures whether the GPU actually overlaps them, before any model code changes:

- components, each alone: paged decode attention (FlashInfer's tensor-core decode wrapper, as
  `worker/attention/flashinfer_backend.py` runs it) for 256 and 512 requests, and one layer's
  GEMMs (qkv, o, gate_up, SiLU-and-mul, down: `F.linear` as the model runs them) for 256 and 512
  rows;
- `serial512`: per layer the attention of 512 requests, then their GEMMs (today's step);
- `serial2x256`: per layer half A's attention and GEMMs, then half B's, one stream;
- `nano2x256`: per layer two phases, each joined before the next: A's attention beside B's
  GEMMs, then B's attention beside A's GEMMs (two streams, fork/join with events);
- `free2x256`: the same kernels on two streams with no join between layers (an upper bound on
  overlap; not a valid schedule of a model).

Each schedule runs over `--layers` distinct layers (distinct weights and KV, far beyond L2),
captured in one CUDA graph (fork/join inside the capture) and timed by replays with CUDA events;
per-layer times are the graph time / layers. Variants of the concurrent schedules: stream
priorities, the attention plan without split-KV or with a fixed split size, cuBLAS told to use
fewer SMs (`torch._C._set_sm_carveout_experimental`), and the attention on a CUDA green context
holding part of the SMs, the GEMMs on an ordinary stream (eager, where the device and torch
allow it). Printed per page size:
`concurrent / serial` (nano2x256 / serial2x256) and `nano / today` (nano2x256 / serial512).

The results file is rewritten after each page size and when the run is stopped (SIGTERM, e.g.
`timeout`), so a partial run keeps what it measured; `--from-log FILE` rebuilds the results of a
run from its printed rows instead (marked reconstructed). docs/serving_roofline.md has the H200's
numbers (docs/results/h200_overlap_probe.json).

    python bench/overlap_probe.py --out docs/results/h200_overlap_probe.json
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ceilings import copy_TBps, cuda_time_ms, matmul_TFLOPs  # noqa: E402
from bench.common import provenance  # noqa: E402
from radix_runtime.model_source import MODEL_CONFIG_DIR  # noqa: E402

# the shape: the runtime's own Llama-3.1-8B config (radix_runtime/worker/model_configs)
_CFG = json.loads(Path(MODEL_CONFIG_DIR, "llama-3.1-8b.json").read_text())
HIDDEN, INTER = _CFG["hidden_size"], _CFG["intermediate_size"]
HEADS, KV_HEADS = _CFG["num_attention_heads"], _CFG["num_key_value_heads"]
HEAD_DIM = HIDDEN // HEADS
Q_SIZE, KV_SIZE = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
MODEL_LAYERS = _CFG["num_hidden_layers"]
# one layer's four projections: qkv, o, gate_up, down
LAYER_WEIGHTS = (
    HIDDEN * (Q_SIZE + 2 * KV_SIZE) + Q_SIZE * HIDDEN + HIDDEN * 2 * INTER + INTER * HIDDEN
)


def layer_gemm_flops(rows: int) -> float:
    """2 FLOPs per weight per row over one layer's four projections."""
    return 2.0 * rows * LAYER_WEIGHTS


def layer_weight_bytes() -> int:
    return 2 * LAYER_WEIGHTS  # bf16


def kv_layout(bs: int, ctx: int, page_size: int) -> tuple[list[int], list[int], int]:
    """Pages per request and each request's last page length for `bs` requests of `ctx`
    tokens; returns (pages per request, last page lengths, pages in all)."""
    per_req = -(-ctx // page_size)
    last = ctx - (per_req - 1) * page_size
    return [per_req] * bs, [last] * bs, per_req * bs


class Half:
    """One nano-batch: its queries, its attention wrapper (own workspace and index buffers:
    the two halves' attention may be planned together and must not share scratch) and the
    activations its GEMMs read and write."""

    def __init__(self, first_req: int, bs: int, ctx: int, page_size: int, layers: int,
                 plan_kw: dict) -> None:  # fmt: skip
        import flashinfer

        dev = torch.device("cuda")
        self.bs = bs
        pages, last, total = kv_layout(bs, ctx, page_size)
        first_page = first_req * pages[0]
        indptr = torch.arange(0, total + 1, pages[0], dtype=torch.int32)
        self.indices = torch.arange(first_page, first_page + total, dtype=torch.int32, device=dev)
        self.last = torch.tensor(last, dtype=torch.int32)
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.empty(bs + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=self.indices.clone(),
            paged_kv_last_page_len_buffer=torch.empty(bs, dtype=torch.int32, device=dev),
        )
        self.wrapper.plan(
            indptr, self.indices, self.last, HEADS, KV_HEADS, HEAD_DIM, page_size,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
            sm_scale=HEAD_DIM**-0.5, **plan_kw,
        )  # fmt: skip
        self.q = torch.randn(layers, bs, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        self.x = torch.randn(bs, HIDDEN, dtype=torch.bfloat16, device=dev)
        self.attn_out = torch.randn(bs, Q_SIZE, dtype=torch.bfloat16, device=dev)


class Probe:
    def __init__(self, ctx: int, page_size: int, layers: int, max_bs: int) -> None:
        dev = torch.device("cuda")
        self.ctx, self.page_size, self.layers = ctx, page_size, layers
        _, _, total = kv_layout(max_bs, ctx, page_size)
        shape = (total, page_size, KV_HEADS, HEAD_DIM)
        self.kv = []
        for _ in range(layers):
            k = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_()
            v = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_()
            self.kv.append((k, v))
        self.w = [
            {
                "qkv": torch.randn(Q_SIZE + 2 * KV_SIZE, HIDDEN, dtype=torch.bfloat16, device=dev)
                * 0.02,
                "o": torch.randn(HIDDEN, Q_SIZE, dtype=torch.bfloat16, device=dev) * 0.02,
                "gate_up": torch.randn(2 * INTER, HIDDEN, dtype=torch.bfloat16, device=dev) * 0.02,
                "down": torch.randn(HIDDEN, INTER, dtype=torch.bfloat16, device=dev) * 0.02,
            }
            for _ in range(layers)
        ]

    def halves(self, sizes: list[int], plan_kw: dict | None = None) -> list[Half]:
        out, first = [], 0
        for bs in sizes:
            out.append(Half(first, bs, self.ctx, self.page_size, self.layers, plan_kw or {}))
            first += bs
        return out

    def attn(self, h: Half, layer: int) -> None:
        h.attn_out.view(h.bs, HEADS, HEAD_DIM).copy_(
            h.wrapper.run(h.q[layer], self.kv[layer])
        )  # the copy stands in for the view the o projection reads (a few us)

    def gemms(self, h: Half, layer: int) -> None:
        import flashinfer

        w = self.w[layer]
        h.x.copy_(F.linear(h.attn_out, w["o"]))
        act = flashinfer.activation.silu_and_mul(F.linear(h.x, w["gate_up"]))
        h.x.copy_(F.linear(act, w["down"]))
        h.q[(layer + 1) % self.layers].view(h.bs, -1).copy_(
            F.linear(h.x, w["qkv"])[:, :Q_SIZE]
        )  # the next layer's queries (their RoPE and K/V store are small)


def graph_ms(fn: Callable[[], None], iters: int) -> float:
    """fn captured once into a CUDA graph (after a warm-up on a side stream), replays timed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = cuda_time_ms(g.replay, 3, iters)
    del g
    return ms


def eager_ms(fn: Callable[[], None], iters: int) -> float:
    return cuda_time_ms(fn, 3, iters)


def two_streams(a_stream: torch.cuda.Stream, b_stream: torch.cuda.Stream, phases) -> None:
    """Each phase is (work on a_stream, work on b_stream); both streams join the current one
    after every phase (fork/join with events, valid inside a graph capture)."""
    main = torch.cuda.current_stream()
    for work_a, work_b in phases:
        a_stream.wait_stream(main)
        b_stream.wait_stream(main)
        with torch.cuda.stream(a_stream):
            work_a()
        with torch.cuda.stream(b_stream):
            work_b()
        main.wait_stream(a_stream)
        main.wait_stream(b_stream)


def schedules(p: Probe, a: Half, b: Half, s_attn, s_gemm) -> dict[str, Callable[[], None]]:
    L = range(p.layers)

    def nano() -> None:
        phases = []
        for i in L:
            phases.append((lambda i=i: p.attn(a, i), lambda i=i: p.gemms(b, i)))
            phases.append((lambda i=i: p.attn(b, i), lambda i=i: p.gemms(a, i)))
        two_streams(s_attn, s_gemm, phases)

    def free() -> None:
        def attn_all() -> None:
            for i in L:
                p.attn(a, i)
                p.attn(b, i)

        def gemm_all() -> None:
            for i in L:
                p.gemms(b, i)
                p.gemms(a, i)

        two_streams(s_attn, s_gemm, [(attn_all, gemm_all)])

    return {"nano2x256": nano, "free2x256": free}


def probe_page_size(args, page_size: int, log, out: dict) -> None:
    """Fill `out` (the caller's, so that what was measured survives an interruption)."""
    out["page_size"] = page_size
    p = Probe(args.context, page_size, args.layers, 2 * args.half)
    a, b = p.halves([args.half, args.half])
    (full,) = p.halves([2 * args.half])
    L, it = range(p.layers), args.iters
    t0 = time.monotonic()

    def per_layer(ms: float) -> float:
        return ms / p.layers

    def rec(name: str, fn: Callable[[], None], timer=graph_ms) -> float | None:
        try:
            ms = per_layer(timer(fn, it))
        except Exception as e:  # a variant the device or library refuses: record why
            out[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            log(f"  page {page_size} {name}: FAILED {type(e).__name__}: {str(e)[:200]}")
            traceback.print_exc(limit=3)
            return None
        out[name] = ms
        log(f"  page {page_size} {name}: {ms * 1e3:.1f} us/layer  [{time.monotonic() - t0:.0f} s]")
        return ms

    # components alone
    rec("attn256_ms", lambda: [p.attn(a, i) for i in L])
    rec("attn512_ms", lambda: [p.attn(full, i) for i in L])
    g256 = rec("gemm256_ms", lambda: [p.gemms(a, i) for i in L])
    g512 = rec("gemm512_ms", lambda: [p.gemms(full, i) for i in L])
    for rows, ms in ((args.half, g256), (2 * args.half, g512)):
        if ms:
            out[f"gemm{rows}_TFLOPs"] = layer_gemm_flops(rows) / (ms * 1e-3) / 1e12
    kv_layer = 2 * args.half * args.context * 2 * KV_SIZE * 2  # K and V, bf16, both halves
    if out.get("attn512_ms"):
        out["attn512_TBps"] = kv_layer / (out["attn512_ms"] * 1e-3) / 1e12

    # serial schedules (one stream)
    s512 = rec("serial512_ms", lambda: [(p.attn(full, i), p.gemms(full, i)) for i in L])
    s2 = rec(
        "serial2x256_ms",
        lambda: [(p.attn(a, i), p.gemms(a, i), p.attn(b, i), p.gemms(b, i)) for i in L],
    )

    def concurrent(tag: str, halves=(a, b), prio=(0, 0), timer=graph_ms, streams=None) -> None:
        s_attn, s_gemm = streams or (
            torch.cuda.Stream(priority=prio[0]),
            torch.cuda.Stream(priority=prio[1]),
        )
        for name, fn in schedules(p, *halves, s_attn, s_gemm).items():
            ms = rec(f"{name}{tag}_ms", fn, timer)
            if ms and name == "nano2x256":
                if s2:
                    out[f"concurrent_over_serial{tag}"] = ms / s2
                if s512:
                    out[f"nano_over_serial512{tag}"] = ms / s512

    concurrent("")
    lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") \
        else (0, -1)  # fmt: skip
    out["stream_priority_range"] = [lo, hi]
    concurrent("_gemm_hi_prio", prio=(0, hi))
    concurrent("_attn_hi_prio", prio=(hi, 0))
    concurrent("_eager", timer=eager_ms)
    concurrent("_gemm_hi_prio_eager", prio=(0, hi), timer=eager_ms)

    # the attention plan: no split-KV (one CTA per request and KV head) or a fixed split size
    for tag, kw in (("_no_split", {"disable_split_kv": True}),
                    ("_split512", {"fixed_split_size": 512})):  # fmt: skip
        try:
            ha, hb = p.halves([args.half, args.half], kw)
            (hf,) = p.halves([2 * args.half], kw)
        except Exception as e:
            out[f"plan{tag}"] = {"error": f"{type(e).__name__}: {e}"[:400]}
            log(f"  page {page_size} plan{tag}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        rec(f"attn256{tag}_ms", lambda ha=ha: [p.attn(ha, i) for i in L])
        rec(f"serial512{tag}_ms", lambda hf=hf: [(p.attn(hf, i), p.gemms(hf, i)) for i in L])
        concurrent(tag, halves=(ha, hb))
        del ha, hb, hf

    # cuBLAS on fewer SMs (the attention keeps them all)
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        out["carveout"] = {"error": "torch has no _set_sm_carveout_experimental"}
    else:
        for carve in args.carveouts:
            try:
                setter(carve)
                rec(f"gemm256_carve{carve}_ms", lambda: [p.gemms(a, i) for i in L])
                concurrent(f"_carve{carve}")
            finally:
                setter(None)

    # the attention on a green context with part of the SMs, the GEMMs on an ordinary stream
    # (eager: graph capture of green-context streams is not assumed)
    gc_mod = getattr(torch.cuda, "green_contexts", None)
    for attn_sms in args.green_attn_sms:
        tag = f"_green{attn_sms}"
        try:
            if gc_mod is None or not getattr(gc_mod, "SUPPORTED", False):
                raise RuntimeError("torch has no green context support")
            ga = gc_mod.GreenContext.create(num_sms=attn_sms, device_id=0)
            if hasattr(ga, "Stream"):
                s_attn = ga.Stream()
            else:  # older torch: a stream made while the green context is current
                ga.set_context()
                try:
                    s_attn = torch.cuda.Stream()
                finally:
                    ga.pop_context()
            s_gemm = torch.cuda.Stream()
        except Exception as e:
            out[f"nano2x256{tag}_ms"] = {"error": f"{type(e).__name__}: {e}"[:400]}
            log(f"  page {page_size} green {attn_sms}: unavailable: {str(e)[:200]}")
            continue
        rec(
            f"attn256{tag}_ms",
            lambda s=s_attn: _on(s, lambda: [p.attn(a, i) for i in L]),
            eager_ms,
        )
        concurrent(tag, timer=eager_ms, streams=(s_attn, s_gemm))


def _on(stream: torch.cuda.Stream, fn: Callable[[], None]) -> None:
    main = torch.cuda.current_stream()
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        fn()
    main.wait_stream(stream)


def summary(res: dict) -> dict:
    """The full-model step implied by the per-layer times (32 layers; the norms, RoPE, KV
    store, LM head and sampling left out: ~1.5 ms measured by bench/gpu_worker.py)."""
    out = {}
    for ps in res["page_sizes"]:
        r = res[f"page{ps}"]
        best = min(
            ((k, v) for k, v in r.items() if k.startswith("nano2x256") and isinstance(v, float)),
            key=lambda kv: kv[1],
            default=(None, None),
        )
        s512, s2 = r.get("serial512_ms"), r.get("serial2x256_ms")
        out[f"page{ps}"] = {
            "serial512_step_ms": s512 * MODEL_LAYERS if isinstance(s512, float) else None,
            "serial2x256_step_ms": s2 * MODEL_LAYERS if isinstance(s2, float) else None,
            "best_nano_variant": best[0],
            "best_nano_step_ms": best[1] * MODEL_LAYERS if best[1] else None,
            "best_concurrent_over_serial": best[1] / s2 if best[1] and s2 else None,
            "best_nano_over_serial512": best[1] / s512 if best[1] and s512 else None,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--context", type=int, default=1537, help="tokens of KV per request (1,536 + the new one)"
    )
    p.add_argument("--half", type=int, default=256, help="requests in each nano-batch")
    p.add_argument("--layers", type=int, default=8, help="distinct layers per timed graph")
    p.add_argument("--page-sizes", default="1,16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--carveouts", default="32,66", help="SMs cuBLAS leaves free, comma-separated")
    p.add_argument("--green-attn-sms", default="64,96", help="SMs of the attention's green context")
    p.add_argument("--out", help="write the results (JSON) here")
    p.add_argument(
        "--from-log",
        metavar="FILE",
        help="no measuring: rebuild the results of a run from its printed log (for a run that "
        "was stopped before it wrote --out; see parse_log)",
    )
    args = p.parse_args()
    if args.from_log:
        res = parse_log(Path(args.from_log).read_text())
        finish(res, print)
        write(args.out, res, {"reconstructed": True, "from_log": args.from_log})
        return
    args.carveouts = [int(x) for x in args.carveouts.split(",") if x]
    args.green_attn_sms = [int(x) for x in args.green_attn_sms.split(",") if x]
    page_sizes = [int(x) for x in args.page_sizes.split(",") if x]
    if not torch.cuda.is_available():
        sys.exit("overlap_probe: needs a CUDA device")
    import flashinfer

    def log(msg: str) -> None:
        print(msg, flush=True)

    dev = torch.device("cuda")
    ceil = {
        "copy_TBps": copy_TBps(dev),
        "matmul_TFLOPs": matmul_TFLOPs(dev, torch.bfloat16),
        "sms": torch.cuda.get_device_properties(dev).multi_processor_count,
    }
    torch.cuda.empty_cache()
    log(f"ceilings: {ceil}")
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flashinfer": getattr(flashinfer, "__version__", None),
        "shape": {
            "hidden": HIDDEN,
            "intermediate": INTER,
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "context": args.context,
            "half": args.half,
            "layers_timed": args.layers,
        },  # fmt: skip
        "layer_weight_GB": layer_weight_bytes() / 1e9,
        "ceilings": ceil,
        "page_sizes": page_sizes,
    }
    # a timeout's SIGTERM ends the run through `finally`: what was measured is still written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("overlap_probe: terminated"))
    try:
        for ps in page_sizes:
            res[f"page{ps}"] = {}
            probe_page_size(args, ps, log, res[f"page{ps}"])
            torch.cuda.empty_cache()  # the page size's pool and weights are gone with its frame
            write(args.out, res, provenance(ceil))
    finally:
        finish(res, log)
        write(args.out, res, provenance(ceil))


def finish(res: dict, log) -> None:
    res["summary"] = summary(res)

    def f(x) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    for ps in res["page_sizes"]:
        r, s = res.get(f"page{ps}", {}), res["summary"].get(f"page{ps}", {})
        log(f"page {ps}: concurrent / serial {f(r.get('concurrent_over_serial'))} "
            f"(best {s.get('best_nano_variant')}: {f(s.get('best_concurrent_over_serial'))}); "
            f"nano / today {f(r.get('nano_over_serial512'))} "
            f"(best {f(s.get('best_nano_over_serial512'))})")  # fmt: skip


def write(path: str | None, res: dict, prov: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"provenance": prov, **res}, f, indent=2)


_LOG_ROW = re.compile(r"^\s*page (\d+) (\S+): ([0-9.]+) us/layer")


def parse_log(text: str) -> dict:
    """The results of a run rebuilt from its printed log (the `page N name: X us/layer` rows and
    the `ceilings:` line): per-layer times in ms as the run would have written them, the ratios
    and the summary recomputed. Rows the log lacks (a run stopped early) are absent."""
    res: dict = {"page_sizes": []}
    for line in text.splitlines():
        if line.startswith("ceilings: "):
            res["ceilings"] = json.loads(line.removeprefix("ceilings: ").replace("'", '"'))
        row = _LOG_ROW.match(line)
        if row is None:
            continue
        ps, name, us = int(row[1]), row[2], float(row[3])
        if ps not in res["page_sizes"]:
            res["page_sizes"].append(ps)
            res[f"page{ps}"] = {"page_size": ps}
        res[f"page{ps}"][name] = us / 1e3
    for ps in res["page_sizes"]:
        r = res[f"page{ps}"]
        for name, ms in list(r.items()):
            m = re.fullmatch(r"nano2x256(.*)_ms", name)
            if m and isinstance(ms, float):
                tag = m[1]
                if isinstance(r.get("serial2x256_ms"), float):
                    r[f"concurrent_over_serial{tag}"] = ms / r["serial2x256_ms"]
                if isinstance(r.get("serial512_ms"), float):
                    r[f"nano_over_serial512{tag}"] = ms / r["serial512_ms"]
    res["summary"] = summary(res)
    return res


if __name__ == "__main__":
    main()
