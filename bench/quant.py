"""Quantized serving on the GPU: bf16 beside FP8 and int4 weights (and the FP8 KV cache) in one run.

Drives `ModelRunner` in-process (as bench/gpu_worker.py does, with its `Bench` driver): Llama-3.1-8B
shape, dummy weights. Per variant (`bf16`; `fp8` = `--quantization fp8` with the W8A16 GEMV on
every one-token product (`KernelConfig.fp8_mma_max_rows` 0); `fp8_mma` = the default kernels (the
W8A8 tensor-core GEMV on products of >= `fp8_mma_min_n` rows), `fp8_mma_all` on every product;
`+head` = with `--quantize-lm-head` (`fp8+head`: the tensor-core GEMV on the head only); `int4` =
`--quantization int4`, packed W4A16 with the Triton int4 GEMV for decode; `fp8_kv` = bf16
weights with `--kv-cache-dtype fp8_e4m3`; `fp8+fp8_kv` both; `fp8_nopdl` / `fp8_mma_nopdl`: `fp8`
/ `fp8_mma` without dependent launches, decode only):
- decode at batch 1 over a 1,024-token context, the worker's overlapped schedule with its CUDA
  graph (`decode_bs1_ms`, tok/s) and the graph replay alone; the weight bytes each step reads over
  that time as a fraction of the read-bandwidth ceiling (`read_TBps`, bench/gpu_worker.py's
  streaming GEMV on the LM head's shape, measured in the same run): each variant's own roofline,
  since its weights have their own size;
- with `--timeline`, the graphed step by kernel role (`kernel_timeline`: each projection's and
  phase's GPU time per step, what it adds to the step and how early it starts, from a
  torch.profiler trace of the graph replays);
- prefill of 8,192 tokens in one chunk (wall ms);
- KV bytes per token (the pool's capacity in a fixed memory budget is inversely proportional);
- the FP8 GEMV's (BLOCK_N, BLOCK_K, warps) and the int4 GEMV's (BLOCK_Q, BLOCK_KW, warps) on the
  one-token layer's four GEMVs (with their fused norm / SiLU prologues and residual adds), against
  the bf16 GEMV on the same case (each timed over distinct weights in one CUDA graph, more than
  L2 holds): what kernels/gemv.py's FP8_GEMV_CONFIGS and kernels/int4_gemv.py's
  INT4_GEMV_CONFIGS hold (`--sweeps fp8,int4`);
- `--sweeps fp8_mma`: the tensor-core GEMV's tiles on the same cases and the LM head's shape
  against the W8A16 and bf16 GEMVs (kernels/fp8_gemv.py's FP8_MMA_CONFIGS), on gate/up also 2-16
  rows against per-token quantization + torch._scaled_mm; `--sweeps prefill_gemm`: the FP8
  prefill's GEMMs at 8K tokens (row-wise and tensor-wise _scaled_mm, the quantization kernel)
  against cuBLAS bf16.
Ratios against bf16 (`*_vs_bf16`) are what the goals are set on: decode FP8 >= 1.8x and int4
>= 3.0x, prefill 8K FP8 >= 1.6x (int4's prefill dequantizes each projection per call: reported,
not a goal).

    python bench/quant.py --out docs/results/h200_quant.json
    python bench/quant.py --variants bf16,fp8,int4 --sweeps int4,fp8 \
        --out docs/results/h200_quant_kernels.json             # the weights (run_h200.sh int4)
    python bench/quant.py --variants bf16,fp8,fp8+head,fp8_mma,fp8_mma+head,int4,int4+head \
        --sweeps fp8_mma --out docs/results/h200_quant_fp8_mma.json   # (run_h200.sh fp8_mma)
    python bench/quant.py --no-sweep --timeline --out docs/results/h200_quant_timeline.json \
        --variants bf16,fp8,fp8_mma,fp8_mma+head,int4,int4+head,fp8_nopdl,fp8_mma_nopdl
                                                                  # (run_h200.sh quant_timeline)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ceilings import cuda_time_ms
from bench.common import provenance, write_json
from bench.gpu_worker import (
    Bench,
    profiled,
    read_bandwidth_TBps,
    weight_bytes_per_decode_step,
)
from radix_runtime.config import ServerArgs
from radix_runtime.worker.kv_pool import KVPool
from radix_runtime.worker.model_runner import ModelRunner

VARIANTS = {
    "bf16": {},
    "fp8": {"quantization": "fp8"},
    "fp8_mma": {"quantization": "fp8"},
    "fp8_mma_all": {"quantization": "fp8"},
    "fp8_mma_all+head": {"quantization": "fp8", "quantize_lm_head": True},
    "fp8_nopdl": {"quantization": "fp8"},
    "fp8_mma_nopdl": {"quantization": "fp8"},
    "fp8+head": {"quantization": "fp8", "quantize_lm_head": True},
    "fp8_mma+head": {"quantization": "fp8", "quantize_lm_head": True},
    "int4+head": {"quantization": "int4", "quantize_lm_head": True},
    "int4": {"quantization": "int4"},
    "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8+fp8_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
}
# a variant's KernelConfig fields beside the defaults (what it A/Bs against the variant without)
VARIANT_KERNELS = {
    "fp8": {"fp8_mma_max_rows": 0},
    "fp8_mma": {},  # the default: the tensor-core GEMV on wide FP8 products (fp8_mma_min_n)
    "fp8_mma_all": {"fp8_mma_min_n": 0},  # on every FP8 projection
    "fp8_mma_all+head": {"fp8_mma_min_n": 0},
    "fp8+head": {"fp8_mma_min_n": 65536},  # on the FP8 LM head only
    # without dependent launches (what they hide of each GEMV; decode only)
    "fp8_nopdl": {"fp8_mma_max_rows": 0, "pdl": False},
    "fp8_mma_nopdl": {"pdl": False},
}
DECODE_ONLY = ("fp8_nopdl", "fp8_mma_nopdl")  # diagnostic variants: no prefill


class QuantBench(Bench):
    def fill_random_kv(self, first_page: int, end_page: int) -> None:
        """Random K/V (an FP8 pool has no normal_: drawn in bf16, then cast)."""
        for buf in self.runner.kv_pool.k_buffers + self.runner.kv_pool.v_buffers:
            part = buf[first_page:end_page]
            part.copy_(torch.randn(part.shape, device=part.device, dtype=torch.bfloat16))


def measure(name: str, flags: dict, args, read_tbps: float) -> dict:
    from radix_runtime.worker.kernels import KernelConfig

    t0 = time.perf_counter()
    kernels = VARIANT_KERNELS.get(name)
    runner = ModelRunner(
        ServerArgs(
            model=args.model,
            load_format="dummy",
            context_length=16384,
            max_total_tokens=args.prefill_tokens + 2 * args.context + 4096,
            max_running_requests=8,
            cuda_graph_max_bs=1,
            cuda_graph_max_extend_tokens=0,
            **flags,
        ),
        kernels=None if kernels is None else KernelConfig(**kernels),
    )
    out = {
        "flags": flags,
        "kernels": kernels,
        "init_s": time.perf_counter() - t0,
        "quantization": runner.quantization,
    }
    out["kv_cache_dtype"] = runner.kv_pool.kv_cache_dtype
    c = runner.config
    out["kv_bytes_per_token"] = KVPool.bytes_per_token(
        c.num_layers, c.num_kv_heads, c.head_dim, runner.kv_pool.dtype
    )
    bench = QuantBench(runner)
    w_bytes = weight_bytes_per_decode_step(runner)
    ms = bench.decode_overlapped(1, args.context)
    out.update(weight_GB_per_decode_step=w_bytes / 1e9, decode_bs1_ms=ms, decode_bs1_tok_s=1e3 / ms)
    out["decode_bs1_read_bw_fraction"] = w_bytes / (ms * 1e-3) / 1e12 / read_tbps
    if runner.cuda_graphs is not None and 1 in runner.cuda_graphs.graphs:
        graph_ms = cuda_time_ms(runner.cuda_graphs.graphs[1].replay, 3, 20)
        out["decode_bs1_graph_ms"] = graph_ms
        out["decode_bs1_graph_read_bw_fraction"] = w_bytes / (graph_ms * 1e-3) / 1e12 / read_tbps
        if args.timeline:
            out["decode_bs1_timeline"] = kernel_timeline(runner.cuda_graphs.graphs[1].replay)
    if name not in DECODE_ONLY:
        out[f"prefill_{args.prefill_tokens}_ms"] = bench.prefill(args.prefill_tokens, 1, 3)
    del bench, runner
    gc.collect()
    torch.cuda.empty_cache()
    print(name, {k: v for k, v in out.items() if not isinstance(v, dict)}, flush=True)
    return out


def kernel_timeline(fn, steps: int = 5, roles: tuple[str, ...] = ("qkv", "o", "gate_up", "down")):
    """Where a step's GPU time goes, by kernel role: `steps` calls of `fn` (a graph replay)
    under torch.profiler; each kernel's duration, and its marginal time (its end minus the
    previous kernel's end: what it adds to the step, its overlap with the kernel before it under
    dependent launches excluded) and its gap (its start minus the previous kernel's end: negative
    when it started early), summed per role in us per step (median over the steps). The step's
    matmul kernels take `roles` in turn, per layer, the last one "lm_head"; the others are named
    by their phase (bench/kernel_phases.py)."""
    import json
    import tempfile

    fn()
    torch.cuda.synchronize()
    prof = profiled(fn, steps)
    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            trace = json.load(g)
    kernels = [
        (e["ts"], e["dur"], e["name"])
        for e in trace["traceEvents"]
        if e.get("cat") == "kernel" and "dur" in e
    ]
    return timeline_by_role(kernels, steps, roles)


def timeline_by_role(kernels: list, steps: int, roles: tuple[str, ...]) -> dict:
    """`kernel_timeline`'s sums from (start us, duration us, name) of `steps` equal steps."""
    import statistics

    from bench.kernel_phases import kernel_phase

    kernels = sorted(kernels)
    per_step = len(kernels) // steps
    if per_step * steps != len(kernels) or per_step == 0:
        return {"error": f"{len(kernels)} kernels in {steps} steps"}
    by_role: dict[str, dict[str, list[float]]] = {}
    spans = []
    for s in range(steps):
        ks = kernels[s * per_step : (s + 1) * per_step]
        mm = [i for i, k in enumerate(ks) if kernel_phase(k[2]) == "matmul"]
        labels = {i: roles[j % len(roles)] for j, i in enumerate(mm[:-1])}
        if mm:
            labels[mm[-1]] = "lm_head"
        sums: dict[str, list[float]] = {}
        prev_end = ks[0][0]
        for i, (ts, dur, name) in enumerate(ks):
            row = sums.setdefault(labels.get(i, kernel_phase(name)), [0.0, 0.0, 0.0, 0])
            row[0] += dur
            row[1] += max(ts + dur, prev_end) - prev_end
            row[2] += ts - prev_end
            row[3] += 1
            prev_end = max(prev_end, ts + dur)
        spans.append(prev_end - ks[0][0])
        for role, row in sums.items():
            for key, v in zip(("dur_us", "marginal_us", "gap_us", "kernels"), row):
                by_role.setdefault(role, {}).setdefault(key, []).append(v)
    return {
        "kernels_per_step": per_step,
        "span_us": statistics.median(spans),
        "by_role": {
            role: {key: statistics.median(v) for key, v in d.items()}
            for role, d in sorted(by_role.items(), key=lambda kv: -sum(kv[1]["marginal_us"]))
        },
    }


# the one-token layer's four GEMVs of the 8B shape: (name, rows, cols, prologue, residual add)
ROW_CASES = (
    ("qkv", 6144, 4096, 1, False),  # rmsnorm(residual) * w in
    ("o", 4096, 4096, 0, True),  # into the residual
    ("gate_up", 28672, 4096, 1, False),
    ("down", 4096, 14336, 2, True),  # SiLU(gate) * up in, into the residual
)
FP8_CONFIGS = [(2, 2048, 4), (4, 1024, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 4),
               (8, 1024, 8), (16, 256, 4), (16, 512, 4), (16, 512, 8), (32, 256, 4),
               (2, 1024, 8), (4, 512, 4), (4, 1024, 8), (2, 1024, 4)]  # fmt: skip
# (BLOCK_Q, BLOCK_KW, warps[, prefetch]) (kernels/int4_gemv.py's int4_gemv config)
INT4_CONFIGS = [(bq, bkw, w) for bq in (1, 2, 4, 8) for bkw, w in
                ((64, 2), (128, 2), (128, 4), (256, 4), (256, 8))]  # fmt: skip
INT4_CONFIGS += [(2, 128, 4, 1), (4, 128, 4, 1), (2, 256, 8, 1), (4, 256, 8, 1)]
# the narrow cases (4,096 rows: few programs) also try more warps per program
INT4_NARROW_CONFIGS = [(2, 256, 8), (4, 256, 8), (2, 512, 8), (4, 512, 8), (4, 512, 16),
                       (1, 256, 8), (2, 256, 4), (4, 256, 4), (2, 256, 8, 1), (4, 256, 8, 1),
                       (2, 128, 4, 1)]  # fmt: skip


def _row_inputs(n: int, k: int, prologue: int, add: bool) -> tuple[torch.Tensor, dict]:
    """The case's input row and the GEMV's fused-op arguments (norm weight, SiLU, residual)."""
    x = torch.randn(1, 2 * k if prologue == 2 else k, device="cuda", dtype=torch.bfloat16)
    kw: dict = {}
    if prologue == 1:
        kw["norm_weight"] = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    elif prologue == 2:
        kw["silu"] = True
    if add:
        kw["add_to"] = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    return x, kw


def _copies(nbytes: int, total: float = 256e6) -> int:
    return max(2, int(total // nbytes))


def gemv_fp8_sweep() -> dict:
    """The FP8 GEMV's (BLOCK_N, BLOCK_K, warps) on the one-token layer's four cases, against the
    bf16 GEMV on the same case: us per product and weight TB/s, each variant over distinct
    weights beyond L2 in one CUDA graph (bench/gemv_sweep.py's graph_us)."""
    from bench.gemv_sweep import graph_us
    from radix_runtime.worker.kernels import gemv

    out = {}
    for name, n, k, prologue, add in ROW_CASES:
        x, kw = _row_inputs(n, k, prologue, add)
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(_copies(2 * n * k))]  # fmt: skip
        case = {"bf16_us": graph_us([lambda w=w, x=x, kw=kw: gemv.gemv(x, w, **kw) for w in w16])}
        del w16
        ws = []
        for _ in range(_copies(n * k)):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            scale = w.float().abs().amax(1) / 448.0
            ws.append(((w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale))
        case["fp8_default_us"] = graph_us(
            [lambda w=w, x=x, kw=kw: gemv.gemv(x, w[0], w_scale=w[1], **kw) for w in ws]
        )
        sweep = {
            cfg: graph_us(
                [
                    lambda w=w, c=cfg, x=x, kw=kw: gemv.gemv(x, w[0], w_scale=w[1], config=c, **kw)
                    for w in ws
                ]
            )
            for cfg in FP8_CONFIGS
        }
        best = min(sweep, key=sweep.get)
        case.update(
            fp8_best_config=list(best),
            fp8_best_us=sweep[best],
            fp8_best_TBps=n * k / sweep[best] / 1e6,
            bf16_TBps=2 * n * k / case["bf16_us"] / 1e6,
            fp8_us={str(list(c)): t for c, t in sorted(sweep.items(), key=lambda kv: kv[1])},
        )
        out[f"{name} {n}x{k}"] = case
        del ws
        torch.cuda.empty_cache()
        print("gemv_fp8", name, {k2: v for k2, v in case.items() if k2 != "fp8_us"}, flush=True)
    return out


def gemv_int4_sweep(top: int = 4) -> dict:
    """The int4 GEMV's (BLOCK_Q, BLOCK_KW, warps) on the one-token layer's four cases (the whole
    grid on gate_up, the `top` best of it and INT4_NARROW_CONFIGS on the others), against the bf16
    GEMV on the same case:
    us per product and weight TB/s (packed bytes + the GEMV's scales); on gate_up also the GEMV,
    the few-rows GEMV, the int4 GEMM and cuBLAS (bf16) by input rows (the KernelConfig
    thresholds). Each variant
    runs over distinct weights beyond L2, in one CUDA graph."""
    from bench.gemv_sweep import graph_us
    from radix_runtime.worker.kernels import gemv
    from radix_runtime.worker.kernels.int4_gemv import (
        int4_gemm,
        int4_gemv,
        int4_gemv_rows,
        int4_gemv_scales,
        interleave_quads,
        pack_int4_rows,
    )
    from radix_runtime.worker.quant import rtn_int4_parts

    out = {}
    order = sorted(ROW_CASES, key=lambda c: c[0] != "gate_up")  # gate_up first: the full grid
    configs = INT4_CONFIGS
    for name, n, k, prologue, add in order:
        x, kw = _row_inputs(n, k, prologue, add)
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(_copies(n * k // 2))]  # fmt: skip
        packed = []
        for w in w16:
            q, z, s, g = rtn_int4_parts(w)
            packed.append((interleave_quads(pack_int4_rows(q)), int4_gemv_scales(s, z), g, s, z))
        bf16_us = graph_us(
            [lambda w=w, x=x, kw=kw: gemv.gemv(x, w, **kw) for w in w16[: _copies(2 * n * k)]]
        )
        del w16
        int4_bytes = sum(t.numel() * t.element_size() for t in packed[0][:2])
        sweep = {
            cfg: graph_us(
                [lambda p=p, c=cfg, x=x, kw=kw: int4_gemv(x, *p[:3], c, **kw) for p in packed]
            )
            for cfg in configs
        }
        best = min(sweep, key=sweep.get)
        case = {
            "bf16_us": bf16_us,
            "bf16_TBps": 2 * n * k / bf16_us / 1e6,
            "int4_bytes": int4_bytes,
            "int4_best_config": list(best),
            "int4_best_us": sweep[best],
            "int4_best_TBps": int4_bytes / sweep[best] / 1e6,
            "int4_best_vs_bf16": bf16_us / sweep[best],
            "int4_us": {str(list(c)): t for c, t in sorted(sweep.items(), key=lambda kv: kv[1])},
        }
        if name == "gate_up":  # where the GEMV, the int4 GEMM and cuBLAS cross over in rows
            configs = sorted(sweep, key=sweep.get)[:top]
            configs += [c for c in INT4_NARROW_CONFIGS if c not in configs]
            w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            rows = {}
            for m in (1, 2, 4, 8, 16, 64):
                xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t = {"cublas_bf16_us": graph_us([lambda w=w, xm=xm: F.linear(xm, w) for w in w16])}
                t["int4_gemm_us"] = graph_us(
                    [lambda p=p, xm=xm: int4_gemm(xm, p[0], p[3], p[4], p[2]) for p in packed]
                )
                if m <= 8:
                    t["int4_gemv_us"] = graph_us(
                        [lambda p=p, xm=xm: int4_gemv(xm, *p[:3]) for p in packed]
                    )
                if m > 1:
                    t["int4_gemv_rows_us"] = graph_us(
                        [lambda p=p, xm=xm: int4_gemv_rows(xm, *p[:3]) for p in packed]
                    )
                rows[m] = t
            case["by_rows"] = rows
            del w16
        out[f"{name} {n}x{k}"] = case
        del packed
        torch.cuda.empty_cache()
        print("gemv_int4", name, {k2: v for k2, v in case.items() if k2 != "int4_us"}, flush=True)
    return out


# (BLOCK_N, BLOCK_K, warps, stages, swap) of kernels/fp8_gemv.py's tensor-core GEMV
FP8_MMA_SWEEP = [(32, 512, 4, 3, 0), (64, 256, 4, 4, 0), (64, 256, 4, 4, 1), (64, 512, 4, 3, 1),
                 (64, 1024, 4, 2, 1), (128, 256, 4, 3, 1), (128, 256, 8, 4, 1),
                 (128, 512, 8, 3, 1)]  # fmt: skip
# the LM head (a plain product): what an FP8 head would run
MMA_CASES = (*ROW_CASES, ("lm_head", 128256, 4096, 0, False))


def gemv_fp8_mma_sweep() -> dict:
    """The W8A8 tensor-core GEMV (kernels/fp8_gemv.py) on the one-token layer's four cases and
    the LM head's shape, over FP8_MMA_SWEEP, against the bf16 GEMV and the W8A16 FP8 GEMV
    (kernels/gemv.py with `w_scale`, its table's config) on the same case: us per product and
    weight TB/s, each over distinct weights beyond L2 in one CUDA graph; the best config's
    relative error against `fp8_mma_gemv_torch`; on gate_up also 2-16 input rows against
    per-token quantization + torch._scaled_mm (the FP8 layer's own forward)."""
    from bench.gemv_sweep import graph_us
    from radix_runtime.worker.kernels import fp8_gemv, gemv
    from radix_runtime.worker.quant import fp8_linear_cuda

    out = {}
    for name, n, k, prologue, add in MMA_CASES:
        x, kw = _row_inputs(n, k, prologue, add)
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(_copies(2 * n * k))]  # fmt: skip
        case = {"bf16_us": graph_us([lambda w=w, x=x, kw=kw: gemv.gemv(x, w, **kw) for w in w16])}
        del w16
        ws = []
        for _ in range(_copies(n * k)):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            scale = w.float().abs().amax(1) / 448.0
            ws.append(((w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale))
        del w
        case["w8a16_us"] = graph_us(
            [lambda w=w, x=x, kw=kw: gemv.gemv(x, w[0], w_scale=w[1], **kw) for w in ws]
        )
        sweep, errors = {}, {}
        for cfg in FP8_MMA_SWEEP:
            try:
                sweep[cfg] = graph_us([
                    lambda w=w, c=cfg, x=x, kw=kw: fp8_gemv.fp8_mma_gemv(x, *w, config=c, **kw)
                    for w in ws
                ])  # fmt: skip
            except Exception as e:  # a tile Triton cannot lower: recorded, not fatal
                errors[str(list(cfg))] = f"{type(e).__name__}: {str(e)[:200]}"
        if sweep:
            best = min(sweep, key=sweep.get)
            kw1 = dict(kw)
            if add:
                kw1["add_to"] = kw["add_to"].clone()
            got = fp8_gemv.fp8_mma_gemv(x, *ws[0], config=best, **kw1)
            if add:
                kw1["add_to"] = kw["add_to"].clone()
            want = fp8_gemv.fp8_mma_gemv_torch(x, *ws[0], **kw1)
            case.update(
                mma_best_config=list(best),
                mma_best_us=sweep[best],
                mma_best_TBps=n * k / sweep[best] / 1e6,
                mma_best_rel_err=((got.float() - want.float()).norm() / want.float().norm()).item(),
                mma_vs_w8a16=case["w8a16_us"] / sweep[best],
                mma_vs_bf16=case["bf16_us"] / sweep[best],
            )
        case["bf16_TBps"] = 2 * n * k / case["bf16_us"] / 1e6
        case["w8a16_TBps"] = n * k / case["w8a16_us"] / 1e6
        case["mma_us"] = {str(list(c)): t for c, t in sorted(sweep.items(), key=lambda kv: kv[1])}
        case["mma_errors"] = errors
        if name == "gate_up" and sweep:
            rows = {}
            for m in (2, 4, 8, 16):
                xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                rows[m] = {
                    "mma_us": graph_us(
                        [
                            lambda w=w, xm=xm, c=best: fp8_gemv.fp8_mma_gemv(xm, *w, config=c)
                            for w in ws
                        ]
                    ),  # fmt: skip
                    "scaled_mm_us": graph_us(
                        [lambda w=w, xm=xm: fp8_linear_cuda(xm, w[0], w[1], None) for w in ws]
                    ),
                }
            case["by_rows"] = rows
        out[f"{name} {n}x{k}"] = case
        del ws
        torch.cuda.empty_cache()
        print("gemv_fp8_mma", name, {k2: v for k2, v in case.items() if k2 != "mma_us"}, flush=True)
    return out


def prefill_gemm_probe(m: int = 8192) -> dict:
    """The FP8 prefill's GEMMs at `m` tokens on the four projections of the 8B layer: cuBLAS
    bf16, the FP8 layer's forward (per-token quantization kernel + row-wise torch._scaled_mm),
    the row-wise and the tensor-wise _scaled_mm alone, and the quantization kernel alone (us)."""
    from bench.gemv_sweep import graph_us
    from radix_runtime.worker.kernels.fp8_quant import quantize_rows_fp8
    from radix_runtime.worker.quant import fp8_linear_cuda

    out = {}
    for name, n, k, _, _ in ROW_CASES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        case = _prefill_case(x, w, graph_us, quantize_rows_fp8, fp8_linear_cuda)
        out[f"{name} {n}x{k}"] = case
        del x, w
        torch.cuda.empty_cache()
        print("prefill_gemm", name, case, flush=True)
    return out


def _prefill_case(x, w, graph_us, quantize_rows_fp8, fp8_linear_cuda, reps: int = 3) -> dict:
    scale = w.float().abs().amax(1) / 448.0
    wq = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
    xq, xs = quantize_rows_fp8(x)
    one = torch.ones((), device="cuda")

    def rowwise():
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=scale.view(1, -1),
                                out_dtype=torch.bfloat16)  # fmt: skip

    def tensorwise():
        return torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    case = {
        "bf16_us": graph_us([lambda: F.linear(x, w)] * reps),
        "fp8_layer_us": graph_us([lambda: fp8_linear_cuda(x, wq, scale, None)] * reps),
        "rowwise_mm_us": graph_us([rowwise] * reps),
        "tensorwise_mm_us": graph_us([tensorwise] * reps),
        "quantize_us": graph_us([lambda: quantize_rows_fp8(x)] * reps),
    }
    case["fp8_layer_vs_bf16"] = case["bf16_us"] / case["fp8_layer_us"]
    return case


def apply_best_configs(results: dict) -> dict:
    """The sweeps' best configs into kernels/gemv.py's FP8_GEMV_CONFIGS and kernels/int4_gemv.py's
    INT4_GEMV_CONFIGS (this process only), so that the variants measured next run them; returns
    what was applied (the tables to commit when they differ from the code's)."""
    from radix_runtime.worker.kernels import fp8_gemv, gemv, int4_gemv

    applied: dict = {}
    for sweep, table, what in (
        ("gemv_fp8", gemv.FP8_GEMV_CONFIGS, "fp8_best_config"),
        ("gemv_int4", int4_gemv.INT4_GEMV_CONFIGS, "int4_best_config"),
        ("gemv_fp8_mma", fp8_gemv.FP8_MMA_CONFIGS, "mma_best_config"),
    ):
        for name, n, k, prologue, add in MMA_CASES:
            case = results.get(sweep, {}).get(f"{name} {n}x{k}")
            if case is not None and what in case:
                table[(n, k, prologue, add)] = tuple(case[what])
                applied.setdefault(sweep, {})[name] = case[what]
    return applied


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--no-sweep", action="store_true", help="skip the FP8 and int4 GEMV sweeps")
    p.add_argument(
        "--sweeps",
        default="fp8,int4",
        help="which sweeps run (fp8, int4, fp8_mma: the tensor-core FP8 GEMV; prefill_gemm: the "
        "FP8 prefill's GEMMs at 8K tokens)",
    )
    p.add_argument(
        "--keep-configs",
        action="store_true",
        help="measure the variants with the code's GEMV tables, not this run's sweep winners",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also each variant's graphed decode step by kernel role (kernel_timeline)",
    )
    p.add_argument("--out")
    args = p.parse_args()
    read_tbps = read_bandwidth_TBps()
    results: dict = {
        "provenance": provenance({"read_TBps": read_tbps, "reference": "bf16, same run"}),
        "device": torch.cuda.get_device_name(),
        "model": args.model,
        "read_TBps": read_tbps,
        "variants": {},
    }
    sweeps = set() if args.no_sweep else set(args.sweeps.split(","))
    if "int4" in sweeps:
        results["gemv_int4"] = gemv_int4_sweep()
        if args.out:
            write_json(args.out, results)
    if "fp8" in sweeps:
        results["gemv_fp8"] = gemv_fp8_sweep()
        if args.out:
            write_json(args.out, results)
    if "fp8_mma" in sweeps:
        results["gemv_fp8_mma"] = gemv_fp8_mma_sweep()
        if args.out:
            write_json(args.out, results)
    if "prefill_gemm" in sweeps:
        results["prefill_gemm"] = prefill_gemm_probe(args.prefill_tokens)
        if args.out:
            write_json(args.out, results)
    if not args.keep_configs:  # the variants below run this run's best GEMV configs
        results["applied_configs"] = apply_best_configs(results)
    for name in filter(None, args.variants.split(",")):
        try:
            results["variants"][name] = measure(name, VARIANTS[name], args, read_tbps)
        except Exception as e:  # recorded; the other variants still run
            results.setdefault("failed_variants", {})[name] = f"{type(e).__name__}: {e}"[:500]
            print("variant", name, "failed:", e, flush=True)
            gc.collect()
            torch.cuda.empty_cache()
        if args.out:  # what was measured so far survives a later failure
            write_json(args.out, results)
    base = results["variants"].get("bf16")
    pre = f"prefill_{args.prefill_tokens}_ms"
    for name, v in results["variants"].items():
        if base is not None and name != "bf16":
            v["decode_bs1_vs_bf16"] = base["decode_bs1_ms"] / v["decode_bs1_ms"]
            if pre in v:
                v[f"{pre.removesuffix('_ms')}_vs_bf16"] = base[pre] / v[pre]
            v["kv_tokens_vs_bf16"] = base["kv_bytes_per_token"] / v["kv_bytes_per_token"]
    if args.out:
        write_json(args.out, results)
    print(
        {n: {k: v[k] for k in v if k.endswith("vs_bf16")} for n, v in results["variants"].items()}
    )


if __name__ == "__main__":
    main()
