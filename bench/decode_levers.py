"""Batch-1 decode levers on the GPU, each against the current kernels in the same run.

- `models`: a batch-1 decode step (CUDA graph) of each model / weight format with
  `KernelConfig.pdl` off and on (programmatic dependent launch of the one-token path's Triton
  kernels: each starts while the one before it finishes), the step's GPU time by kernel
  (torch.profiler) and host wall time per step on the worker's overlapped schedule, and whether
  the two configurations sample the same tokens;
- `attention`: the split-KV decode attention at batch 1 over 1,024-token contexts for each
  (splits, BLOCK_T, warps), one layer-distinct KV per call as a model reads them;
- `gemv`: the bf16 GEMV's (BLOCK_N, BLOCK_K, warps) on the family shapes whose tables are not
  measured yet (Gemma 3 12B's hidden size 3,840, Qwen3 8B's MLP and LM head), with their prologue.

    python bench/decode_levers.py --out decode_levers.json [--parts models,attention,gemv]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ceilings import copy_TBps, cuda_time_ms  # noqa: E402
from bench.common import provenance  # noqa: E402
from bench.gemv_sweep import graph_us  # noqa: E402
from bench.gpu_worker import Bench, kernel_profile, weight_bytes_per_decode_step  # noqa: E402
from radix_runtime import messages as m  # noqa: E402
from radix_runtime.config import ServerArgs  # noqa: E402
from radix_runtime.worker.cuda_graph import CudaGraphRunner  # noqa: E402
from radix_runtime.worker.kernels import _triton, gemv  # noqa: E402
from radix_runtime.worker.kernels.decode_attention import decode_attention  # noqa: E402
from radix_runtime.worker.model_runner import ModelRunner  # noqa: E402

DEV = torch.device("cuda")
MODELS = ("llama-3.1-8b:none", "llama-3.1-8b:fp8", "llama-3.1-8b:int4", "qwen3-8b:none",
          "mistral-7b:none", "gemma-3-12b:none")  # fmt: skip


def _tokens(bench: Bench, ctx: int, steps: int) -> list[int]:
    """Greedy tokens of `steps` decode steps from one fresh request at `ctx` (the same random
    context and first token each time)."""
    bench.rng = np.random.default_rng(7)
    torch.manual_seed(7)  # the random K/V
    req = bench._first_decodes(1, ctx, steps + 1)[0]
    out = []
    for step in range(steps):
        res = bench.forward([req]).results[0]
        out.append(int(res.next_id))
        req = m.ForwardReq(slot=0, input_ids=m.pack_ids([res.next_id]), start_pos=ctx + step + 1)
    return out


def model_ab(spec: str, ctx: int, copy_bps: float) -> dict:
    name, quant = spec.split(":")
    flags = {} if quant == "none" else {"quantization": quant}
    t0 = time.perf_counter()
    runner = ModelRunner(
        ServerArgs(
            model=name,
            load_format="dummy",
            context_length=8192,
            max_total_tokens=2 * ctx + 4096,
            max_running_requests=8,
            cuda_graph_max_bs=1,
            cuda_graph_max_extend_tokens=0,
            **flags,
        )  # fmt: skip
    )
    out: dict = {"init_s": time.perf_counter() - t0}
    w_bytes = weight_bytes_per_decode_step(runner)
    out["weight_GB_per_decode_step"] = w_bytes / 1e9
    bench = Bench(runner)
    base = runner.kernels
    for pdl in (False, True):
        runner.use_kernels(replace(base, pdl=pdl))
        runner.cuda_graphs = CudaGraphRunner(
            runner.model, runner.attn, runner.kv_pool, 1, runner.max_pages_per_slot, runner.device
        )
        key = "pdl" if pdl else "base"
        ms = bench.decode_overlapped(1, ctx)
        graph_ms = cuda_time_ms(runner.cuda_graphs.graphs[1].replay, 3, 30)
        out[key] = {
            "decode_bs1_ms": ms,
            "decode_bs1_roofline_fraction": w_bytes / (ms * 1e-3) / copy_bps,
            "graph_ms": graph_ms,
            "graph_roofline_fraction": w_bytes / (graph_ms * 1e-3) / copy_bps,
            "profile": kernel_profile(runner.cuda_graphs.graphs[1].replay, 5, top=12),
            "tokens": _tokens(bench, ctx, 8),
        }
    out["pdl_same_tokens"] = out["pdl"]["tokens"] == out["base"]["tokens"]
    out["pdl_speedup"] = out["base"]["decode_bs1_ms"] / out["pdl"]["decode_bs1_ms"]
    out["pdl_graph_speedup"] = out["base"]["graph_ms"] / out["pdl"]["graph_ms"]
    print(spec, json.dumps({k: v for k, v in out.items() if k not in ("base", "pdl")}),
          {k: round(out[k]["decode_bs1_ms"], 4) for k in ("base", "pdl")}, flush=True)  # fmt: skip
    del bench, runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def attention_sweep(ctx: int, layers: int = 32) -> dict:
    """Split-KV decode attention, batch 1, over `layers` distinct KV caches of `ctx` tokens."""
    out = {}
    for label, hkv, group, d in (("llama_d128_g4", 8, 4, 128), ("gemma_d256_g2", 8, 2, 256)):
        caches = [
            (torch.randn(ctx + 1, 1, hkv, d, device=DEV, dtype=torch.bfloat16),
             torch.randn(ctx + 1, 1, hkv, d, device=DEV, dtype=torch.bfloat16))
            for _ in range(layers)
        ]  # fmt: skip
        q = torch.randn(1, hkv * group, d, device=DEV, dtype=torch.bfloat16)
        indptr = torch.tensor([0, ctx], dtype=torch.int32, device=DEV)
        idx = torch.randperm(ctx, device=DEV).int() + 1
        last = torch.ones(1, dtype=torch.int32, device=DEV)
        ref = decode_attention(q, *caches[0], indptr, idx, last, d**-0.5)
        res = {}
        for splits in (4, 8, 16, 32, 64):
            for block_t in (16, 32, 64):
                for warps in (2, 4):
                    fn = partial(decode_attention, q, kv_indptr=indptr, kv_indices=idx,
                                 last_page_len=last, scale=d**-0.5, splits=splits,
                                 block_t=block_t, warps=warps)  # fmt: skip
                    try:
                        got = fn(k_cache=caches[0][0], v_cache=caches[0][1])
                        err = (got.float() - ref.float()).abs().max().item()
                        us = graph_us([partial(fn, k_cache=k, v_cache=v) for k, v in caches])
                    except Exception as exc:  # resources: skip the config
                        print(label, splits, block_t, warps, type(exc).__name__, str(exc)[:100])
                        continue
                    res[f"{splits},{block_t},{warps}"] = {"us": us, "max_abs_err": err}
        ranked = sorted(res.items(), key=lambda kv: kv[1]["us"])
        if not ranked:
            continue
        out[label] = {"current_us": res.get("32,32,4", {}).get("us"), "best": ranked[0],
                      "top8": ranked[:8], "all": res}  # fmt: skip
        print(label, json.dumps(out[label]["best"]), "current", out[label]["current_us"],
              flush=True)  # fmt: skip
        del caches
        torch.cuda.empty_cache()
    return out


# (label, rows, cols, prologue, add): the family shapes the GEMV table does not hold yet
GEMV_CASES = (
    ("gemma12b_qkv", 8192, 3840, gemv.GEMV_PLAIN, False),
    ("gemma12b_o", 3840, 4096, gemv.GEMV_PLAIN, False),
    ("gemma12b_gate_up", 30720, 3840, gemv.GEMV_PLAIN, False),
    ("gemma12b_down_gelu", 3840, 15360, gemv.GEMV_GELU, False),
    ("gemma12b_lm_head", 262208, 3840, gemv.GEMV_PLAIN, False),
    ("qwen3_8b_gate_up", 24576, 4096, gemv.GEMV_NORM, False),
    ("qwen3_8b_down", 4096, 12288, gemv.GEMV_SILU, True),
    ("qwen3_8b_lm_head", 151936, 4096, gemv.GEMV_PLAIN, False),
)
GEMV_GRID = [(1, 2048, 2), (2, 1024, 2), (2, 2048, 2), (4, 1024, 2), (4, 1024, 4), (4, 2048, 4),
             (8, 512, 4), (8, 1024, 4), (16, 256, 4), (2, 256, 2), (4, 256, 2), (8, 256, 4),
             (4, 512, 4), (2, 512, 2)]  # fmt: skip


def gemv_sweep(budget_s: float) -> dict:
    t0 = time.time()
    out = {}
    for label, n, k, prologue, add in GEMV_CASES:
        nbytes = n * k * 2
        copies = max(3, min(32, -(-2 * 2**30 // nbytes)))
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        gated = prologue in (gemv.GEMV_SILU, gemv.GEMV_GELU)
        x = torch.randn(1, 2 * k if gated else k, device=DEV, dtype=torch.bfloat16)
        kw: dict = {}
        if prologue == gemv.GEMV_NORM:
            kw["norm_weight"] = torch.randn(k, device=DEV, dtype=torch.bfloat16)
        elif prologue == gemv.GEMV_SILU:
            kw["silu"] = True
        elif prologue == gemv.GEMV_GELU:
            kw["gelu"] = True
        if add:
            kw["add_to"] = torch.randn(1, n, device=DEV, dtype=torch.bfloat16)
        key = (n, k, prologue, add)
        current = gemv.GEMV_CONFIGS.get(key, gemv.GEMV_DEFAULT_CONFIG[prologue])
        res = {}
        for cfg in [current] + [c for c in GEMV_GRID if c != current]:
            if time.time() - t0 > budget_s:
                break
            try:
                res[cfg] = graph_us([partial(gemv.gemv, x, w, config=cfg, **kw) for w in ws])
            except Exception as exc:
                print(label, cfg, type(exc).__name__, str(exc)[:100])
        if not res:
            break
        best = min(res, key=res.get)
        ref_kw = {k_: v for k_, v in kw.items() if k_ != "add_to"}
        a = gemv.gemv(x, ws[0], config=best, **ref_kw).float()
        b = gemv.gemv_torch(x, ws[0], **ref_kw).float()
        out[label] = {
            "rows": n, "cols": k, "prologue": prologue, "add": add,
            "current_config": list(current), "current_us": res.get(current),
            "best_config": list(best), "best_us": res[best],
            "best_TBps": nbytes / res[best] / 1e6,
            "rel_err": ((a - b).norm() / b.norm()).item(),
            "all_us": {",".join(map(str, c)): t for c, t in sorted(res.items(), key=lambda kv: kv[1])},
        }  # fmt: skip
        print(label, json.dumps({k_: v for k_, v in out[label].items() if k_ != "all_us"}),
              flush=True)  # fmt: skip
        del ws
        torch.cuda.empty_cache()
    return out


def key(spec: str) -> str:
    """A model's key in the results: MODEL:QUANT without dots (docs' figure paths split on them)."""
    return spec.replace(".", "_")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="decode_levers.json")
    ap.add_argument("--parts", default="models,attention,gemv")
    ap.add_argument("--models", default=",".join(MODELS), help="MODEL:QUANT,...")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--gemv-budget-s", type=float, default=150.0)
    args = ap.parse_args()
    parts = args.parts.split(",")
    import triton

    result: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "pdl_supported": _triton.pdl_supported(),
        "context": args.context,
    }
    print(json.dumps(result), flush=True)
    copy_bps = copy_TBps(DEV) * 1e12
    result["copy_TBps"] = copy_bps / 1e12

    def save() -> None:
        ceiling = {"copy_TBps": result["copy_TBps"], "reference": "the current kernels, same run"}
        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(ceiling), **result}, f, indent=1)

    if "attention" in parts:
        result["attention"] = attention_sweep(args.context)
        save()
    if "models" in parts:
        result["models"] = {}
        for spec in args.models.split(","):
            try:
                result["models"][key(spec)] = model_ab(spec, args.context, copy_bps)
            except Exception as exc:  # record it and go on with the next model
                result["models"][key(spec)] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                print(spec, "FAILED", exc, flush=True)
                gc.collect()
                torch.cuda.empty_cache()
            save()
    if "gemv" in parts:
        result["gemv"] = gemv_sweep(args.gemv_budget_s)
        save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
