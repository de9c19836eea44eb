"""How a step reaches the tensor-parallel ranks: the round trip of one ForwardBatch frame (a
batch-64 decode step as the scheduler encodes it) from the scheduler to every rank and back, for
the ways it could travel:
- `push`: one ZeroMQ PUSH socket per rank, the same frame on each (what the runtime does);
- `pub`: one PUB socket, every rank subscribed (needs a handshake before the first step: a PUB
  drops what it sends before a subscription has arrived);
- `relay`: one PUSH to rank 0, which broadcasts the frame to the others over a gloo group (the
  length, then the bytes), as SGLang's rank 0 does with its requests.
Each rank acknowledges on a PUSH back; the time is until the scheduler holds every ack.

    python bench/tp_dispatch.py --ranks 2 --iters 2000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zmq

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import provenance
from radix_runtime import messages as m


def step_frame(batch: int = 64) -> bytes:
    reqs = [
        m.ForwardReq(slot=i, input_ids=b"", start_pos=500, from_last_sample=True,
                     new_pages=m.pack_ids([1000 + i]), page_offset=500)
        for i in range(batch)
    ]  # fmt: skip
    return m.encode(m.ForwardBatch(step=1, reqs=reqs))


def rank_main(mode: str, rank: int, ranks: int, d: str, iters: int) -> None:
    ctx = zmq.Context()
    ack = ctx.socket(zmq.PUSH)
    ack.connect(f"ipc://{d}/ack")
    if mode == "relay":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{d}/rdzv", rank=rank, world_size=ranks)
    if mode == "pub":
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(f"ipc://{d}/pub")
    elif mode == "push" or rank == 0:
        sock = ctx.socket(zmq.PULL)
        sock.bind(f"ipc://{d}/r{rank}")
    ack.send(b"ready")
    if mode == "pub":  # the handshake: hellos until the publisher sees all subscribed
        while sock.recv() != b"go":
            pass
    for _ in range(iters):
        if mode == "relay":
            if rank == 0:
                frame = sock.recv()
                n = torch.tensor([len(frame)])
            else:
                n = torch.zeros(1, dtype=torch.long)
            dist.broadcast(n, 0)
            buf = (
                torch.frombuffer(bytearray(frame), dtype=torch.uint8)
                if rank == 0
                else torch.empty(int(n), dtype=torch.uint8)
            )
            dist.broadcast(buf, 0)
            frame = buf.numpy().tobytes()
        else:
            frame = sock.recv()
        m.decode(frame)
        ack.send(b"k")


def run(mode: str, ranks: int, iters: int) -> dict:
    d = tempfile.mkdtemp(prefix="tp_dispatch-")
    ctx = zmq.Context()
    acks = ctx.socket(zmq.PULL)
    acks.bind(f"ipc://{d}/ack")
    if mode == "pub":
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"ipc://{d}/pub")
    procs = [
        mp.get_context("spawn").Process(target=rank_main, args=(mode, r, ranks, d, iters))
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    for _ in range(ranks):
        acks.recv()
    if mode == "pub":
        time.sleep(0.5)  # subscriptions propagate; then "go" (a real server would need acks)
        pub.send(b"go")
        socks = [pub]
    else:
        socks = []
        targets = range(ranks) if mode == "push" else [0]
        for r in targets:
            s = ctx.socket(zmq.PUSH)
            s.connect(f"ipc://{d}/r{r}")
            socks.append(s)
    frame = step_frame()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for s in socks:
            s.send(frame, copy=False)
        for _ in range(ranks):
            acks.recv()
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join(30)
    times = times[iters // 10 :]  # warm-up
    return {
        "median_us": statistics.median(times) * 1e6,
        "p99_us": sorted(times)[int(len(times) * 0.99)] * 1e6,
        "frame_bytes": len(frame),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    modes = {mode: run(mode, a.ranks, a.iters) for mode in ("push", "pub", "relay")}
    result = {
        "provenance": provenance("the same frame's round trip for each way, same run", None, argv),
        "config": vars(a),
        "modes": modes,
        "relay_over_push": modes["relay"]["median_us"] / modes["push"]["median_us"],
        "pub_over_push": modes["pub"]["median_us"] / modes["push"]["median_us"],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
