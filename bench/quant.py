"""Quantized serving on the GPU: bf16 beside FP8 and int4 weights (and the FP8 KV cache) in one run.

Drives `ModelRunner` in-process (as bench/gpu_worker.py does, with its `Bench` driver): Llama-3.1-8B
shape, dummy weights. Per variant (`bf16`; `fp8` = `--quantization fp8`; `int4` = `--quantization
int4`, packed W4A16 with the Triton int4 GEMV for decode; `fp8_kv` = bf16 weights with
`--kv-cache-dtype fp8_e4m3`; `fp8+fp8_kv` both):
- decode at batch 1 over a 1,024-token context, the worker's overlapped schedule with its CUDA
  graph (`decode_bs1_ms`, tok/s) and the graph replay alone; the weight bytes each step reads over
  that time as a fraction of the read-bandwidth ceiling (`read_TBps`, bench/gpu_worker.py's
  streaming GEMV on the LM head's shape, measured in the same run): each variant's own roofline,
  since its weights have their own size;
- prefill of 8,192 tokens in one chunk (wall ms);
- KV bytes per token (the pool's capacity in a fixed memory budget is inversely proportional);
- the FP8 GEMV's rows per program against the bf16 GEMV on the two largest projections, and the
  int4 GEMV's (BLOCK_N, BLOCK_KW, warps) grid on the four 8B projections against the bf16 GEMV
  (each timed over distinct weights in one CUDA graph, more than L2 holds).
Ratios against bf16 (`*_vs_bf16`) are what the goals are set on: decode FP8 >= 1.8x and int4
>= 3.0x, prefill 8K FP8 >= 1.6x (int4's prefill dequantizes each projection per call: reported,
not a goal).

    python bench/quant.py --out docs/results/h200_quant.json
    python bench/quant.py --variants bf16,int4 --sweeps int4   # int4 vs bf16 (run_h200.sh int4)
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

from bench.common import provenance, write_json
from bench.gpu_worker import (
    Bench,
    cuda_time_ms,
    read_bandwidth_TBps,
    weight_bytes_per_decode_step,
)
from radix_runtime.config import ServerArgs
from radix_runtime.worker.kv_pool import KVPool
from radix_runtime.worker.model_runner import ModelRunner

VARIANTS = {
    "bf16": {},
    "fp8": {"quantization": "fp8"},
    "int4": {"quantization": "int4"},
    "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8+fp8_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
}


class QuantBench(Bench):
    def fill_random_kv(self, first_page: int, end_page: int) -> None:
        """Random K/V (an FP8 pool has no normal_: drawn in bf16, then cast)."""
        for buf in self.runner.kv_pool.k_buffers + self.runner.kv_pool.v_buffers:
            part = buf[first_page:end_page]
            part.copy_(torch.randn(part.shape, device=part.device, dtype=torch.bfloat16))


def measure(name: str, flags: dict, args, read_tbps: float) -> dict:
    t0 = time.perf_counter()
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
        )
    )
    out = {"flags": flags, "init_s": time.perf_counter() - t0, "quantization": runner.quantization}
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
    out[f"prefill_{args.prefill_tokens}_ms"] = bench.prefill(args.prefill_tokens, 1, 3)
    del bench, runner
    gc.collect()
    torch.cuda.empty_cache()
    print(name, {k: v for k, v in out.items() if not isinstance(v, dict)}, flush=True)
    return out


def gemv_fp8_sweep() -> dict:
    """The FP8 GEMV's rows per program (`FP8_GEMV_ROWS_FACTOR` x the bf16 table's BLOCK_N) on the
    two largest 8B projections, against the bf16 GEMV on the same shape: us and weight TB/s."""
    out = {f"{n}x{k}": _gemv_case(n, k) for n, k in ((28672, 4096), (4096, 14336))}
    torch.cuda.empty_cache()
    print("gemv", out, flush=True)
    return out


def _gemv_case(n: int, k: int) -> dict:
    from radix_runtime.worker.kernels import gemv

    base = gemv.GEMV_CONFIGS.get((n, k, gemv.GEMV_PLAIN, False), (4, 1024, 4))
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    scale = w16.float().abs().amax(1) / 448.0
    w8 = (w16.float() / scale[:, None]).to(torch.float8_e4m3fn)
    bf16_ms = cuda_time_ms(lambda: gemv.gemv(x, w16), 5, 50)
    case = {"bf16_us": bf16_ms * 1e3, "bf16_TBps": 2 * n * k / (bf16_ms * 1e-3) / 1e12}
    for f in (1, 2, 4):
        cfg = (base[0] * f, base[1], base[2])
        ms = cuda_time_ms(lambda c=cfg: gemv.gemv(x, w8, w_scale=scale, config=c), 5, 50)
        case[f"fp8_rows_x{f}_us"] = ms * 1e3
        case[f"fp8_rows_x{f}_TBps"] = n * k / (ms * 1e-3) / 1e12
    return case


INT4_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # qkv, o, gate_up, down
INT4_CONFIGS = [(bn, bkw, w) for bn in (4, 8, 16) for bkw in (32, 64, 128, 256) for w in (4, 8)]


def gemv_int4_sweep(copies_bytes: float = 256e6) -> dict:
    """The int4 GEMV per (BLOCK_N, BLOCK_KW, warps) on each 8B projection, against the bf16 GEMV
    on the same shape: us per product and weight TB/s (packed bytes + scales + zeros), best
    config first; on gate_up also the GEMV, the int4 GEMM and cuBLAS (bf16) by input rows (the
    KernelConfig thresholds). Each variant runs over distinct weights beyond L2, in one graph."""
    from bench.gemv_sweep import graph_us
    from radix_runtime.worker.kernels import gemv
    from radix_runtime.worker.kernels.int4_gemv import int4_gemm, int4_gemv, pack_int4_rows
    from radix_runtime.worker.quant import rtn_int4_parts

    out = {}
    for n, k in INT4_SHAPES:
        copies = max(2, int(copies_bytes // (n * k // 2)))
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        packed = []
        for w in w16:
            q, z, s, g = rtn_int4_parts(w)
            packed.append((pack_int4_rows(q), s, z, g))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        bf16_us = graph_us([lambda w=w, x=x: gemv.gemv(x, w) for w in w16])
        del w16
        int4_bytes = sum(t.numel() * t.element_size() for t in packed[0][:3])
        sweep = {}
        for cfg in INT4_CONFIGS:
            sweep[cfg] = graph_us([lambda p=p, c=cfg, x=x: int4_gemv(x, *p, c) for p in packed])
        best = min(sweep, key=sweep.get)
        default_us = graph_us([lambda p=p, x=x: int4_gemv(x, *p) for p in packed])
        out[f"{n}x{k}"] = {
            "bf16_us": bf16_us,
            "bf16_TBps": 2 * n * k / bf16_us / 1e6,
            "int4_default_us": default_us,
            "int4_best_config": list(best),
            "int4_best_us": sweep[best],
            "int4_best_TBps": int4_bytes / sweep[best] / 1e6,
            "int4_best_vs_bf16": bf16_us / sweep[best],
            "int4_us": {str(list(c)): t for c, t in sorted(sweep.items(), key=lambda kv: kv[1])},
        }
        if (n, k) == (28672, 4096):  # where the GEMV, the GEMM and cuBLAS cross over in rows
            w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            rows = {}
            for m in (1, 2, 4, 8, 16, 64, 256):
                xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t = {"cublas_bf16_us": graph_us([lambda w=w, xm=xm: F.linear(xm, w) for w in w16])}
                t["int4_gemm_us"] = graph_us([lambda p=p, xm=xm: int4_gemm(xm, *p) for p in packed])
                if m <= 8:
                    t["int4_gemv_us"] = graph_us(
                        [lambda p=p, xm=xm: int4_gemv(xm, *p) for p in packed]
                    )
                rows[m] = t
            out[f"{n}x{k}"]["by_rows"] = rows
            del w16
        del packed
        torch.cuda.empty_cache()
        print("gemv_int4", f"{n}x{k}", {k2: v for k2, v in out[f"{n}x{k}"].items() if k2 != "int4_us"},
              flush=True)  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--no-sweep", action="store_true", help="skip the FP8 and int4 GEMV sweeps")
    p.add_argument("--sweeps", default="fp8,int4", help="which GEMV sweeps run (fp8, int4)")
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
    if "fp8" in sweeps:
        results["gemv_fp8"] = gemv_fp8_sweep()
    if "int4" in sweeps:
        results["gemv_int4"] = gemv_int4_sweep()
    for name in args.variants.split(","):
        results["variants"][name] = measure(name, VARIANTS[name], args, read_tbps)
        if args.out:  # what was measured so far survives a later failure
            write_json(args.out, results)
    base = results["variants"].get("bf16")
    pre = f"prefill_{args.prefill_tokens}_ms"
    for name, v in results["variants"].items():
        if base is not None and name != "bf16":
            v["decode_bs1_vs_bf16"] = base["decode_bs1_ms"] / v["decode_bs1_ms"]
            v[f"{pre.removesuffix('_ms')}_vs_bf16"] = base[pre] / v[pre]
            v["kv_tokens_vs_bf16"] = base["kv_bytes_per_token"] / v["kv_bytes_per_token"]
    if args.out:
        write_json(args.out, results)
    print(
        {n: {k: v[k] for k in v if k.endswith("vs_bf16")} for n, v in results["variants"].items()}
    )


if __name__ == "__main__":
    main()
