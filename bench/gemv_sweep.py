"""Batch-1 GEMV configurations on the GPU, at the 8B model's projection shapes (bf16).

A decode step of one request streams every weight once, so each projection is a matrix-vector
product bound by memory bandwidth. This sweep times `kernels/gemv.py`'s `gemv` over a grid of
(BLOCK_N, BLOCK_K, num_warps) for each case a one-token layer runs (plain; RMSNorm or
SiLU-and-mul prologue; residual-add epilogue), against cuBLAS (F.linear) in the same run, alone
and after FlashInfer's RMSNorm (the unfused alternative to a norm prologue). The JSON's `cases`
are what `KernelConfig` reads from $RADIX_RUNTIME_GEMV_CONFIGS (gemv.GEMV_CONFIGS holds the H200's).

Timing: each variant runs over `copies` distinct weights of the shape (together far larger than
the 60 MB L2, as 32 layers are; one weight timed alone would be served from L2) inside one CUDA
graph; GPU time per product from CUDA events, median of 5 replays. TB/s counts weight bytes read.

    python bench/gemv_sweep.py --out gemv_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import provenance  # noqa: E402
from radix_runtime.worker.kernels import gemv, norms  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
SHAPES = {  # name: (rows, cols) of the weight
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def graph_us(calls: list, replays: int = 5) -> float:
    """GPU microseconds per call of `calls` (a list of thunks), replayed in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in calls:  # warm up (compiles, allocations) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in calls:
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    del g
    return statistics.median(times)


def configs() -> list[tuple[int, int, int]]:
    out = []
    for bn, bk, w in itertools.product((1, 2, 4, 8, 16, 32), (128, 256, 512, 1024, 2048, 4096),
                                       (1, 2, 4, 8)):  # fmt: skip
        tile = bn * bk
        per_thread = tile // (32 * w)
        if 1024 <= tile <= 32768 and 8 <= per_thread <= 128:
            out.append((bn, bk, w))
    return out


CASES = [  # (shape, prologue, add): the products of a fused one-token layer, and plain ones
    ("qkv", gemv.GEMV_PLAIN, False),
    ("qkv", gemv.GEMV_NORM, False),
    ("o", gemv.GEMV_PLAIN, False),
    ("o", gemv.GEMV_PLAIN, True),
    ("gate_up", gemv.GEMV_PLAIN, False),
    ("gate_up", gemv.GEMV_NORM, False),
    ("down", gemv.GEMV_PLAIN, False),
    ("down", gemv.GEMV_SILU, True),
    ("lm_head", gemv.GEMV_PLAIN, False),
]
MODE = {gemv.GEMV_PLAIN: "plain", gemv.GEMV_NORM: "norm", gemv.GEMV_SILU: "silu"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gemv_sweep.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop the grids after this")
    args = ap.parse_args()
    t_start = time.time()
    torch.manual_seed(0)
    grid = configs()
    shapes = args.shapes.split(",")
    result: dict = {"device": torch.cuda.get_device_name(), "configs": len(grid), "shapes": {},
                    "cases": []}  # fmt: skip
    for name in shapes:
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(4, min(32, -(-2 * 2**30 // nbytes)))
        ws = [torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5 for _ in range(copies)]
        x = torch.randn(1, k, device=DEV, dtype=BF16)
        x2 = torch.randn(1, 2 * k, device=DEV, dtype=BF16)
        norm_w = torch.randn(k, device=DEV, dtype=BF16)
        res = torch.randn(1, n, device=DEV, dtype=BF16)
        ref: dict = {"rows": n, "cols": k, "copies": copies}
        ref["cublas_us"] = graph_us([partial(F.linear, x, w) for w in ws])
        # the unfused alternative to a norm prologue: FlashInfer's RMSNorm kernel, then cuBLAS
        pairs = []
        for w in ws:
            pairs += [partial(norms.rmsnorm, x, norm_w, 1e-5), partial(F.linear, x, w)]
        ref["rmsnorm_then_cublas_us"] = graph_us(pairs) * 2
        for key in ("cublas_us", "rmsnorm_then_cublas_us"):
            ref[key.replace("_us", "_TBps")] = nbytes / ref[key] / 1e6
        result["shapes"][name] = ref
        print(json.dumps({name: ref}), flush=True)
        for case_name, prologue, add in CASES:
            if case_name != name:
                continue
            kw: dict = {}
            xin = x2 if prologue == gemv.GEMV_SILU else x
            if prologue == gemv.GEMV_SILU:
                kw["silu"] = True
            elif prologue == gemv.GEMV_NORM:
                kw.update(norm_weight=norm_w, eps=1e-5)
            if add:
                kw["add_to"] = res
            sweep = {}
            label = f"{name}/{MODE[prologue]}{'+add' if add else ''}"
            for cfg in tqdm(grid, desc=label):
                if time.time() - t_start > args.budget_s:
                    break
                try:
                    sweep[cfg] = graph_us([partial(gemv.gemv, xin, w, config=cfg, **kw)
                                           for w in ws])  # fmt: skip
                except Exception as exc:  # a config Triton cannot compile (resources): skip it
                    print(f"{label} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
            ranked = sorted(sweep.items(), key=lambda kv: kv[1])
            best, best_us = ranked[0]
            # error of the best config against the float32 reference
            if add:
                r1, r2 = res.clone(), res.clone()
                kw1, kw2 = dict(kw, add_to=r1), dict(kw, add_to=r2)
                a = gemv.gemv(xin, ws[0], config=best, **kw1).float() - res.float()
                b = gemv.gemv_torch(xin, ws[0], **kw2).float() - res.float()
            else:
                a = gemv.gemv(xin, ws[0], config=best, **kw).float()
                b = gemv.gemv_torch(xin, ws[0], **kw).float()
            case = {
                "name": label,
                "rows": n,
                "cols": k,
                "prologue": prologue,
                "add": add,
                "best_config": list(best),
                "best_us": best_us,
                "best_TBps": nbytes / best_us / 1e6,
                "top5": [[list(c), round(t, 2)] for c, t in ranked[:5]],
                "rel_err": ((a - b).norm() / b.norm()).item(),
            }
            result["cases"].append(case)
            print(json.dumps(case), flush=True)
        del ws
        torch.cuda.empty_cache()
    result["elapsed_s"] = time.time() - t_start
    ceiling = "cuBLAS (F.linear) on the same shapes, in the same run; TB/s counts weight bytes read"
    result = {"provenance": provenance(ceiling), **result}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
