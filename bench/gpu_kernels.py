"""Micro benchmarks of the worker's fused CUDA kernels against the torch ops they replace, in the
same run, at Llama-3.1-8B shapes (bf16): the Triton KV store and RoPE, FlashInfer's fused
residual-add + RMSNorm and SiLU-and-mul; plus two attention choices (paged vs ragged prefill
over a fresh 8K prompt; tensor-core vs CUDA-core decode).

Each op is timed two ways: `eager` (triton.testing.do_bench: one launch per call, launch cost
included: what a prefill step pays) and `graph` (do_bench_cudagraph: replayed in a CUDA graph,
GPU time only: what a decode step pays). Medians, in microseconds.

    python bench/gpu_kernels.py --out gpu_kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import flashinfer
import torch
import torch.nn.functional as F
import triton.testing

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import provenance  # noqa: E402
from radix_runtime.worker.kernels import KernelConfig, activation, norms, rope  # noqa: E402
from radix_runtime.worker.kernels.kv_store import store_kv, store_kv_torch  # noqa: E402
from radix_runtime.worker.kernels.ops import FusedOps  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
H, HKV, D, HIDDEN, INTER = 32, 8, 128, 4096, 14336
OPS = FusedOps(KernelConfig(triton_gemv=True))  # single rows through the Triton GEMV


def us(fn, graph: bool = True) -> dict:
    out = {"eager_us": 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")}
    if graph:
        out["graph_us"] = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return out


def compare(rows: list, op: str, n: int, ours: str, fn_ours, fn_torch, graph: bool = True) -> None:
    a, b = us(fn_ours, graph), us(fn_torch, graph)
    for mode in a:
        rows.append(
            {
                "op": op,
                "tokens": n,
                "mode": mode.removesuffix("_us"),
                ours: a[mode],
                "torch": b[mode],
                "speedup": b[mode] / a[mode],
            }
        )


def kv_store(rows: list) -> None:
    slots = 1 << 18
    k_cache = torch.randn(slots, HKV, D, device=DEV, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    for n in (1, 64, 256, 8192):
        qkv = torch.randn(n, (H + 2 * HKV) * D, device=DEV, dtype=BF16)
        k = torch.randn(n, HKV, D, device=DEV, dtype=BF16)
        v = qkv[:, (H + HKV) * D :].view(-1, HKV, D)  # strided, as the model hands it over
        loc = torch.randperm(slots, device=DEV)[:n]
        compare(
            rows,
            "store_kv",
            n,
            "triton",
            partial(store_kv, k_cache, v_cache, loc, k, v),
            partial(store_kv_torch, k_cache, v_cache, loc, k, v),
        )


def rotary(rows: list) -> None:
    for n in (1, 64, 256, 8192):
        qkv = torch.randn(n, (H + 2 * HKV) * D, device=DEV, dtype=BF16)
        pos = torch.randint(0, 8192, (n,), device=DEV)
        inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
        f = pos.float()[:, None] * inv[None, :]
        emb = torch.cat((f, f), -1)[:, None, :]
        cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
        compare(
            rows,
            "rotary_qk",
            n,
            "triton",
            partial(rope.rotary_qk, qkv, cos, sin, H, HKV, D),
            partial(rope.rotary_qk_torch, qkv, cos, sin, H, HKV, D),
        )


def norm_and_act(rows: list) -> None:
    w = torch.randn(HIDDEN, device=DEV, dtype=BF16)

    def torch_add_norm(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        h = (x + res).float()  # the reference model: h = h + out; norm(h) in float32
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16)

    for n in (1, 256, 8192):
        x = torch.randn(n, HIDDEN, device=DEV, dtype=BF16)
        res = torch.randn_like(x)
        compare(
            rows,
            "add_rmsnorm",
            n,
            "flashinfer",
            partial(norms.fused_add_rmsnorm, x, res, w, 1e-5),
            partial(torch_add_norm, x, res),
        )
        gu = torch.randn(n, 2 * INTER, device=DEV, dtype=BF16)

        compare(
            rows,
            "silu_and_mul",
            n,
            "flashinfer",
            partial(activation._fi_silu_and_mul, gu),
            partial(torch_silu_and_mul, gu),
        )
        compare(
            rows,
            "silu_and_mul",
            n,
            "triton",
            partial(activation.silu_and_mul_triton, gu),
            partial(torch_silu_and_mul, gu),
        )


def gemv(rows: list) -> None:
    """Batch-1 projections of the 8B model: Triton GEMV vs cuBLAS (F.linear), as TB/s read."""
    for name, n, k in [
        ("qkv", 6144, 4096),
        ("o", 4096, 4096),
        ("gate_up", 2 * INTER, 4096),
        ("down", 4096, INTER),
        ("lm_head", 128256, 4096),
    ]:
        w = torch.randn(n, k, device=DEV, dtype=BF16)
        x = torch.randn(1, k, device=DEV, dtype=BF16)
        ref = F.linear(x.double(), w.double())
        err = ((OPS.linear(x, w, None).double() - ref).norm() / ref.norm()).item()
        a = us(partial(OPS.linear, x, w, None))
        b = us(partial(F.linear, x, w))
        for mode in a:
            rows.append(
                {
                    "op": f"gemv_{name}",
                    "tokens": 1,
                    "mode": mode.removesuffix("_us"),
                    "triton": a[mode],
                    "cublas": b[mode],
                    "speedup": b[mode] / a[mode],
                    "triton_TBps": n * k * 2 / a[mode] / 1e6,
                    "cublas_TBps": n * k * 2 / b[mode] / 1e6,
                    "rel_err": err,
                }
            )


def torch_silu_and_mul(t: torch.Tensor) -> torch.Tensor:
    g, u = t.chunk(2, -1)
    return F.silu(g) * u


def attention(rows: list) -> None:
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=DEV)
    # a fresh 8,192-token prompt: paged over its own freshly written pages, or ragged
    n = 8192
    q = torch.randn(n, H, D, device=DEV, dtype=BF16)
    k = torch.randn(n, HKV, D, device=DEV, dtype=BF16)
    v = torch.randn_like(k)
    k_cache, v_cache = k.view(n, 1, HKV, D), v.view(n, 1, HKV, D)  # page size 1
    i32 = dict(dtype=torch.int32)
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    paged.plan(
        torch.tensor([0, n], **i32),
        torch.tensor([0, n], **i32),
        torch.arange(n, device=DEV, **i32),
        torch.tensor([1], **i32),
        H,
        HKV,
        D,
        1,
        causal=True,
        q_data_type=BF16,
    )
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    ragged.plan(
        torch.tensor([0, n], **i32),
        torch.tensor([0, n], **i32),
        H,
        HKV,
        D,
        causal=True,
        q_data_type=BF16,
    )
    a = us(lambda: paged.run(q, (k_cache, v_cache)), graph=False)["eager_us"]
    b = us(lambda: ragged.run(q, k, v), graph=False)["eager_us"]
    rows.append(
        {
            "op": "prefill_attention_8192",
            "mode": "eager",
            "paged_us": a,
            "ragged_us": b,
            "paged_backend": paged._backend,
        }
    )
    # 256 new tokens over 8,192 keys (the cached-TTFT shape) and a fresh 8,192: FA2 vs FA3
    times = {}
    for backend in ("fa2", "fa3"):
        for new in (256, n):
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            w.plan(
                torch.tensor([0, new], **i32),
                torch.tensor([0, n], **i32),
                torch.arange(n, device=DEV, **i32),
                torch.tensor([1], **i32),
                H,
                HKV,
                D,
                1,
                causal=True,
                q_data_type=BF16,
            )
            run = partial(w.run, q[:new], (k_cache, v_cache))
            times[f"{backend}_{new}_us"] = us(run, graph=False)["eager_us"]
    rows.append({"op": "prefill_attention_fa2_vs_fa3", "mode": "eager", **times})
    # decode over 1,024-token contexts: tensor cores or not (GQA group 4)
    ctx = 1024
    for bs in (1, 64, 256):
        pages = bs * ctx
        kc = torch.randn(pages, 1, HKV, D, device=DEV, dtype=BF16)
        vc = torch.randn_like(kc)
        qd = torch.randn(bs, H, D, device=DEV, dtype=BF16)
        times = {}
        for tc in (True, False):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            w.plan(
                torch.arange(0, pages + 1, ctx, **i32),
                torch.arange(pages, device=DEV, **i32),
                torch.ones(bs, **i32),
                H,
                HKV,
                D,
                1,
                q_data_type=BF16,
            )
            times[tc] = us(partial(w.run, qd, (kc, vc)), graph=False)["eager_us"]
        rows.append(
            {
                "op": "decode_attention_ctx1024",
                "tokens": bs,
                "mode": "eager",
                "tensor_cores_us": times[True],
                "cuda_cores_us": times[False],
            }
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    rows: list[dict] = []
    for part in (kv_store, rotary, norm_and_act, gemv, attention):
        part(rows)
    for r in rows:
        print(
            "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
        )
    if args.out:
        with open(args.out, "w") as f:
            ceiling = "the torch (or cuBLAS) version of each op, in the same run"
            result = {"provenance": provenance(ceiling), "device": torch.cuda.get_device_name()}
            json.dump({**result, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
