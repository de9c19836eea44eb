"""The host KV tier's pinned memory (worker/host_pool.py `pinned_empty`): what pinning a pool of
--gb GB costs in host memory and time, at its exact size (cudaHostRegister on plain memory, the
tier's way) against torch's pinned allocator (`pin_memory=True`, which rounds an allocation up
to a power of two), and the host -> device copy rate from each. CUDA only.

    python bench/host_pinning.py [--gb 17.3] [--copy-gb 1] [--out docs/results/h200_host_pinning.json]

Resident memory is the process's (/proc/self/statm) before and after each allocation; the exact
one is freed (unregistered) before torch's is made. 17.3 GB is the host tier of
docs/hicache.md's H200 workload (--hicache-ratio 6 of a 22,000-token pool, 128 KiB a token).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import provenance, write_json
from radix_runtime.worker.host_pool import _host_unregister, pinned_empty


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def copy_rate(host: torch.Tensor, nbytes: int) -> float:
    """Bytes/s of a host -> device copy of the first `nbytes` (the best of 3)."""
    src = host[:nbytes]
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def measure(nbytes: int, copy_bytes: int, exact: bool) -> dict:
    gc.collect()
    before = resident_bytes()
    t0 = time.perf_counter()
    if exact:
        buf, registered = pinned_empty((nbytes,), torch.uint8)
    else:
        buf, registered = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False
    took = time.perf_counter() - t0
    row = {
        "registered": registered,
        "pinned": buf.is_pinned(),
        "alloc_s": took,
        "resident_bytes_added": resident_bytes() - before,
        "copy_bytes_per_s": copy_rate(buf, copy_bytes),
    }
    if registered:
        _host_unregister(buf.data_ptr())
    del buf
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=17.3, help="pool size, GB (1e9 bytes)")
    p.add_argument("--copy-gb", type=float, default=1.0, help="bytes copied to the device, GB")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_pinning: needs CUDA")
        return 2
    torch.cuda.init()
    nbytes, copy_bytes = int(args.gb * 1e9), int(args.copy_gb * 1e9)
    results = {"exact": measure(nbytes, copy_bytes, True)}
    results["torch_allocator"] = measure(nbytes, copy_bytes, False)
    for k, row in results.items():
        print(f"{k:16s} pinned {row['pinned']} registered {row['registered']}: "
              f"{row['alloc_s']:.2f} s, +{row['resident_bytes_added'] / 1e9:.1f} GB resident, "
              f"copy {row['copy_bytes_per_s'] / 1e9:.1f} GB/s")  # fmt: skip
    out = {
        "provenance": provenance("the same pool pinned by torch's pinned allocator, same run"),
        "config": {"bytes": nbytes, "copy_bytes": copy_bytes},
        "results": results,
        "resident_over_requested": {
            k: row["resident_bytes_added"] / nbytes for k, row in results.items()
        },
    }
    if args.out:
        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
