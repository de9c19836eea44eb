"""The host KV tier's copies (worker/host_pool.py) against a plain copy of the same bytes, in-process
(no model, no server).

    python bench/host_copy.py [--device cuda|cpu] [--pages 4096] [--run-lengths 1,16,256]
        [--layers 32 --kv-heads 8 --head-dim 128 --page-size 1 --dtype bfloat16]
        [--out docs/results/cpu_host_copy.json]

A batch of --pages pages (the Llama-3.1-8B shape by default: 128 KiB a page at page size 1) is
loaded from the host pool into the device pool, and written back, through `HostKVPool.copy`;
the host pages are runs of --run-lengths consecutive pages in random order (a run length of 1:
every page on its own), the device pages a random permutation. Per run length, the best of
--repeats of each, interleaved:
- `copy`: one contiguous copy of the same bytes (CUDA: pinned host -> device, the bandwidth
  the tier's loads are judged against; CPU: a host memcpy);
- `load` / `write`: `HostKVPool.copy` (page-major pool, staging buffer, one copy per run on
  CUDA), until the device is done;
- `previous_load` / `previous_write`: the path the tier had before (a layer-major pool
  [layers, 2, pages, ...]; a load gathers the pages on the host with index_select over the
  pages' dim into a freshly allocated pinned tensor, copies it, scatters on the device; a
  write gathers on the device, copies into a fresh pinned tensor and scatters it into the pool
  on the host), kept here as the reference.
Throughput in bytes/s and over `copy`; on CUDA `load_event_s` is the load's time as the server
counts it (`HostKVPool.load_time`: the side stream's events).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from bench.common import provenance, write_json
from radix_runtime.worker.host_pool import HostKVPool
from radix_runtime.worker.kv_pool import KVPool


class PreviousPath:
    """The tier's previous copies: a layer-major pool, host gather into fresh pinned memory."""

    def __init__(self, dev: KVPool, num_pages: int) -> None:
        self.dev, self.cuda = dev, dev.device.type == "cuda"
        shape = (dev.num_layers, 2, num_pages, dev.page_size, dev.kv_heads, dev.head_dim)
        self.buffer = torch.empty(shape, dtype=dev.dtype, pin_memory=self.cuda)
        self.stream = torch.cuda.Stream(dev.device) if self.cuda else None

    def _gather(self, idx):
        d = self.dev
        return torch.stack(
            [torch.stack([d.k_buffers[i][idx], d.v_buffers[i][idx]]) for i in range(d.num_layers)]
        )

    def _scatter(self, idx, pages):
        for i in range(self.dev.num_layers):
            self.dev.k_buffers[i][idx] = pages[i, 0]
            self.dev.v_buffers[i][idx] = pages[i, 1]

    def load(self, src: np.ndarray, dst: np.ndarray) -> None:
        b, s = self.buffer, torch.from_numpy(src.astype(np.int64))
        d = torch.from_numpy(dst.astype(np.int64))
        if not self.cuda:
            self._scatter(d, b[:, :, s])
            return
        staged = torch.empty((*b.shape[:2], len(src), *b.shape[3:]), dtype=b.dtype, pin_memory=True)
        torch.index_select(b, 2, s, out=staged)
        with torch.cuda.stream(self.stream):
            pages = staged.to(self.dev.device, non_blocking=True)
            self._scatter(d.pin_memory().to(self.dev.device, non_blocking=True), pages)
        self.stream.synchronize()

    def write(self, src: np.ndarray, dst: np.ndarray) -> None:
        s, d = torch.from_numpy(src.astype(np.int64)), torch.from_numpy(dst.astype(np.int64))
        if not self.cuda:
            self.buffer[:, :, d] = self._gather(s)
            return
        with torch.cuda.stream(self.stream):
            gathered = self._gather(s.pin_memory().to(self.dev.device, non_blocking=True))
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
        self.stream.synchronize()
        self.buffer[:, :, d] = host


def host_ids(pages: int, run: int, host_pages: int, rng: np.random.Generator) -> np.ndarray:
    """`pages` distinct host page ids (>= 1) in runs of `run` consecutive ids, runs shuffled."""
    slots = (host_pages - 1) // run
    runs = rng.choice(slots, -(-pages // run), replace=False)
    ids = (1 + runs[:, None] * run + np.arange(run)[None, :]).reshape(-1)[:pages]
    return ids.astype(np.int32)


def elapsed_s(fn, sync) -> float:
    """Seconds of one call of `fn`, until `sync` returns."""
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def batch_ops(pool, previous, src, dst, handles, plain) -> dict:
    """name -> the call that queues one batch's copies that way (`handles`: op -> the list its
    load timings go to; `previous`: None leaves its ops out)."""
    none = np.zeros(0, np.int32)
    plain_src, plain_dst = plain
    ops = {
        "copy": lambda: plain_dst.copy_(plain_src, non_blocking=True),
        "load": lambda: handles["load"].append(pool.copy(none, none, src, dst, False)),
        "write": lambda: pool.copy(dst, src, none, none, False),
    }
    if previous is not None:
        ops["previous_load"] = lambda: previous.load(src, dst)
        ops["previous_write"] = lambda: previous.write(dst, src)
    return ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pages", type=int, default=None, help="pages per batch (cuda 4096, cpu 512)")
    p.add_argument("--run-lengths", default="1,16,256")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ops", default=None,
                   help="comma-separated ops to time besides copy (default: all)")  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cuda = device.type == "cuda"
    pages = args.pages or (4096 if cuda else 512)
    dev = KVPool(
        args.layers, pages + 1, args.page_size, args.kv_heads, args.head_dim, dtype, device
    )
    for b in dev.k_buffers + dev.v_buffers:
        b.copy_(torch.randn(b.shape, device=device).to(dtype))
    host_pages = 2 * pages + 1
    wanted = set(args.ops.split(",")) if args.ops else None
    want_previous = wanted is None or bool({"previous_load", "previous_write"} & wanted)
    pool = HostKVPool(dev, host_pages)
    previous = PreviousPath(dev, host_pages) if want_previous else None
    nbytes = pages * pool.page_bytes

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    plain_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    plain_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rng = np.random.default_rng(0)
    results = {}
    for run in [int(r) for r in args.run_lengths.split(",")]:
        src = host_ids(pages, run, host_pages, rng)
        dst = (1 + rng.permutation(pages)).astype(np.int32)
        handles: dict = {"load": []}
        ops = batch_ops(pool, previous, src, dst, handles, (plain_src, plain_dst))
        if wanted is not None:
            ops = {k: f for k, f in ops.items() if k == "copy" or k in wanted}
        for fn in ops.values():  # warm-up (pinned allocations, kernels)
            fn()
            sync()
        seconds = {k: float("inf") for k in ops}
        for _ in range(args.repeats):  # interleaved
            for k, fn in ops.items():
                seconds[k] = min(seconds[k], elapsed_s(fn, sync))
        row = {f"{k}_bytes_per_s": nbytes / s for k, s in seconds.items()}
        for k in ops:
            if k != "copy":
                row[f"{k}_over_copy"] = seconds["copy"] / seconds[k]
        for name, hs in handles.items():  # the loads' time as the server counts it
            if cuda and hs:
                row[f"{name}_event_s"] = min(HostKVPool.load_time(h) for h in hs)
                row[f"{name}_event_over_copy"] = seconds["copy"] / row[f"{name}_event_s"]
        row["runs"] = int(-(-pages // run))
        results[f"run_{run}"] = row
        print(
            f"run length {run:4d}: copy {nbytes / seconds['copy'] / 1e9:7.2f} GB/s | "
            + " | ".join(f"{k} {row[f'{k}_over_copy']:.3f}" for k in ops if k != "copy")
        )
    out = {
        "provenance": provenance(
            "a plain contiguous copy of the same bytes (CUDA: pinned host -> device; CPU: a "
            "host memcpy), in the same run, interleaved"
        ),
        "config": {
            "device": str(device),
            "pages": pages,
            "page_bytes": pool.page_bytes,
            "batch_bytes": nbytes,
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "dtype": args.dtype,
            "staging_pages": pool.chunk_pages,
            "torch_threads": torch.get_num_threads(),
            "repeats": args.repeats,
        },
        "results": results,
    }
    if args.out:
        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
