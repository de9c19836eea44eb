"""A cached turn's chunk attention on the CPU: the C++ kernel against the SDPA it replaced.

    python bench/cpu_chunk_attention.py [--threads 1,2] [--rows 9] [--prefix 900] [--sweeps 100]
                                        [--out docs/results/cpu_chunk_attention.json]

A chat's next turn over its cached history is a prefill chunk of a few rows over ~900 cached
keys. Per thread count, the time of the 30 layers' attention of such a chunk (the default
model's shape: 9 query heads, 3 KV heads, 64 dims), each layer on its own pool of 30,000 slots
so that the keys come from memory as in a step, the chunk's keys on two runs of slots (the
prefix's, then the new tokens' elsewhere) through

- ours: `_cpu_decoder.chunk_attention` (keys and values read through their locations), and
- the reference in the same run: what the chunk ran before, a gathered copy of the keys and
  values (`index_select`) and ATen's flash SDPA with the query heads grouped per KV head and
  the causal mask additive (`torch_native._PrefillChunk.grouped`).

Engines alternate sweep by sweep; reported: the median and min ms of a sweep and ours over the
reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import provenance
from radix_runtime.worker import cpu_native

LAYERS, SLOTS, HEADS, KV_HEADS, DIM = 30, 30_000, 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", type=int, default=9)
    ap.add_argument("--prefix", type=int, default=900)
    ap.add_argument("--sweeps", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ext = cpu_native.load_extension()
    if ext is None:
        sys.exit("the _cpu_decoder extension is not built (python setup.py build_ext --inplace)")
    n, prefix = args.rows, args.prefix
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(SLOTS, KV_HEADS, DIM, generator=g) for _ in range(LAYERS)]
    vs = [torch.randn(SLOTS, KV_HEADS, DIM, generator=g) for _ in range(LAYERS)]
    locs = torch.cat([torch.arange(100, 100 + prefix), torch.arange(20_000, 20_000 + n)])
    q = torch.randn(n, HEADS, DIM, generator=g)
    group = HEADS // KV_HEADS
    sees = torch.arange(prefix + n)[None] <= torch.arange(n)[:, None] + prefix
    additive = torch.zeros(group * n, prefix + n).masked_fill_(~sees.repeat(group, 1), -torch.inf)
    scale = DIM**-0.5

    def ours(i: int) -> torch.Tensor:
        return ext.chunk_attention(q, ks[i], vs[i], locs, prefix, scale)

    def sdpa(i: int) -> torch.Tensor:
        k = ks[i].index_select(0, locs).unsqueeze(0).transpose(1, 2)
        v = vs[i].index_select(0, locs).unsqueeze(0).transpose(1, 2)
        q_c = q.transpose(0, 1).unsqueeze(0).reshape(1, KV_HEADS, group * n, DIM)
        o = F.scaled_dot_product_attention(q_c, k, v, attn_mask=additive[None, None], scale=scale)
        return o.reshape(HEADS, n, DIM).transpose(0, 1)

    torch.testing.assert_close(ours(0), sdpa(0), atol=2e-5, rtol=2e-4)
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {"ours": [], "sdpa": []}
        for _ in range(args.sweeps):
            for name, fn in (("ours", ours), ("sdpa", sdpa)):
                t0 = time.perf_counter()
                for i in range(LAYERS):
                    fn(i)
                times[name].append((time.perf_counter() - t0) * 1e3)
        row = {"threads": threads}
        for name, t in times.items():
            row[f"{name}_ms"] = statistics.median(t)
            row[f"{name}_min_ms"] = min(t)
        row["ours_over_sdpa"] = row["ours_ms"] / row["sdpa_ms"]
        rows.append(row)
        print(
            f"{threads} thread(s), {LAYERS} layers, {n} rows over {prefix} cached keys: ours "
            f"{row['ours_ms']:.2f} ms (min {row['ours_min_ms']:.2f}), gather + SDPA "
            f"{row['sdpa_ms']:.2f} (min {row['sdpa_min_ms']:.2f}): "
            f"{row['ours_over_sdpa']:.2f}x"
        )
    if args.out:
        result = {
            "provenance": provenance("gather + ATen flash SDPA (grouped query heads), same run"),
            "shape": {
                "layers": LAYERS,
                "slots": SLOTS,
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "dim": DIM,
                "rows": n,
                "prefix": prefix,
            },  # fmt: skip
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
