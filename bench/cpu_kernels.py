"""The quantized CPU kernels (csrc/cpu_quant_kernels.cpp) against a read-bandwidth ceiling.

    python bench/cpu_kernels.py [--threads 1,2] [--rows 1,8] [--out docs/results/cpu_kernels.json]

Per projection shape of the default model (SmolLM2-135M: q/k/v 960x576, o 576x576, gate/up
3072x576, down 576x1536; LM head 49152x576 in int8) and per thread count: the time of one
product over `rows` activation rows through

- ours (`cpu_quant.QuantLinear`: int4 for the layers, int8 for the head, two activation passes),
- ATen's weight-only kernels the int formats used before (`_weight_int4pack_mm_for_cpu` with bf16
  activations, `_weight_int8pack_mm`), and the float32 `F.linear`,

each cycled over 30 copies of the weights (one a layer, as a decode step reads them: more bytes
than the last-level cache, so every product streams its weights from memory). The ceiling, in the
same run: a streamed `sum` over as many bytes, on the same threads. Reported: µs a product,
GB/s of weights read, and that over the ceiling. `step` adds up one decode step's products (30
layers + the head) for each engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import provenance
from radix_runtime.worker import cpu_quant

LAYERS = 30
SHAPES = {  # name: (out_features, in_features, per layer?)
    "qkv": (960, 576, True),
    "o": (576, 576, True),
    "gate_up": (3072, 576, True),
    "down": (576, 1536, True),
    "lm_head": (49152, 576, False),
}


def timed(fn, calls: int, min_s: float = 0.3) -> float:
    """Median seconds of one call over repeated sweeps of `calls` calls (at least min_s)."""
    fn(0)
    samples = []
    t_end = time.perf_counter() + min_s
    while time.perf_counter() < t_end or len(samples) < 3:
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        samples.append((time.perf_counter() - t0) / calls)
    samples.sort()
    return samples[len(samples) // 2]


def ceiling_gbs(nbytes: int, copies: int) -> float:
    """GB/s of a streamed float32 sum over `copies` buffers of `nbytes` each, cycled."""
    bufs = [torch.ones(max(nbytes // 4, 1)) for _ in range(copies)]
    s = timed(lambda i: bufs[i % copies].sum(), copies)
    return nbytes / s / 1e9


def engines(name: str, n: int, k: int, copies: int) -> dict[str, tuple[list, int]]:
    """engine -> (the weights of each copy, bytes a copy)"""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.05
    if name == "lm_head":
        ours = cpu_quant.Int8Linear(w, None)
        q8, s8 = _per_channel_int8(w)
        aten = ("int8", q8, s8)
        aten_bytes = q8.numel() + 2 * s8.numel()
    else:
        ours = cpu_quant.Int4Linear(w, None, "asymmetric")
        q4, sz = _aten_int4(w)
        aten = ("int4", q4, sz)
        aten_bytes = q4.numel() * q4.element_size() + sz.numel() * 2
    return {
        "ours": ([_copy_module(ours) for _ in range(copies)], ours.packed.numel()),
        "aten": ([tuple(_clone(t) for t in aten) for _ in range(copies)], aten_bytes),
        "float32": ([w.clone() for _ in range(copies)], w.numel() * 4),
    }


def _clone(t):
    return t.clone() if torch.is_tensor(t) else t


def _copy_module(lin: cpu_quant.QuantLinear) -> cpu_quant.QuantLinear:
    c = cpu_quant.QuantLinear(lin.packed.clone(), lin.out_features, lin.in_features, None)
    c.kind = lin.kind
    return c


def _per_channel_int8(w: torch.Tensor):
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16)


def _aten_int4(w: torch.Tensor):
    q, d, m = cpu_quant.int4_groups(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scale, zero = d.float(), m.float() + 8 * d.float()  # ATen: w = (q - 8) * scale + zero
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, sz


def run_engine(engine: str, weights: list, x: torch.Tensor):
    if engine == "ours":
        return lambda i: weights[i % len(weights)](x)
    if engine == "float32":
        return lambda i: F.linear(x, weights[i % len(weights)])
    xb = x.bfloat16()

    def aten(i):
        kind, q, s = weights[i % len(weights)]
        if kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(xb, q, s)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, q, 32, s)

    return aten


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    ext = cpu_quant.kernels()
    isa = ext.kernel_isa() if ext is not None else "torch twin"
    print(f"kernels: {isa}; weights cycled over {LAYERS} copies")
    results, step = [], {}
    for name, (n, k, per_layer) in SHAPES.items():
        copies = LAYERS if per_layer else 2
        built = engines(name, n, k, copies)
        for t in threads:
            torch.set_num_threads(t)
            ceil = ceiling_gbs(built["ours"][1], copies)
            for r in rows:
                x = torch.randn(r, k)
                row = {"shape": name, "n": n, "k": k, "threads": t, "rows": r, "ceiling_gbs": ceil}
                for engine, (weights, nbytes) in built.items():
                    s = timed(run_engine(engine, weights, x), copies)
                    gbs = nbytes / s / 1e9
                    row[engine] = {
                        "us": s * 1e6,
                        "bytes": nbytes,
                        "gbs": gbs,
                        "of_ceiling": gbs / ceil,
                    }
                    key = (engine, t, r)
                    step[key] = step.get(key, 0.0) + s * 1e6 * (LAYERS if per_layer else 1)
                results.append(row)
                print(
                    f"{name:8s} {n}x{k} t{t} r{r}: ceiling {ceil:5.1f} GB/s | "
                    + " | ".join(
                        f"{e} {row[e]['us']:7.1f} us {row[e]['gbs']:5.1f} GB/s "
                        f"({row[e]['of_ceiling']:.2f})"
                        for e in built
                    )
                )
    steps = [
        {"engine": e, "threads": t, "rows": r, "ms": us / 1e3} for (e, t, r), us in step.items()
    ]
    for s in steps:
        print(
            f"step (30 layers + head): {s['engine']:8s} t{s['threads']} r{s['rows']}: {s['ms']:.2f} ms"
        )
    if args.out:
        ceiling = (
            "a streamed float32 sum over as many bytes as our packed weights, cycled over the same "
            "number of copies, same threads, same run"
        )
        doc = {
            "provenance": provenance(ceiling),
            "kernel_isa": isa,
            "layers": LAYERS,
            "results": results,
            "step": steps,
        }
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
