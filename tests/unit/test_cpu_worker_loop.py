"""The worker process's loop on the CPU (worker/main.py): a step's result goes out before the
next queued batch is computed (on the CPU `launch` runs the whole step, so launching the next
batch first would hold a finished result back a whole step, a first token's TTFT included).

The real worker process behind its real sockets, with a tiny dummy model: two batches are queued
in its inbox before it starts, the second one invalid. The first step's result must arrive
before the second step's failure is reported."""

from __future__ import annotations

import shutil

import zmq

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.utils.procs import endpoint, make_ipc_dir, spawn_child, zmq_socket


def test_cpu_worker_sends_a_result_before_computing_the_next_batch():
    args = ServerArgs(
        model="tiny-llama", load_format="dummy", model_config="tiny-llama", device="cpu",
        max_total_tokens=256, max_running_requests=4,
    )  # fmt: skip
    ipc_dir = make_ipc_dir()
    ctx = zmq.Context()
    to_worker = zmq_socket(ctx, zmq.PUSH, endpoint(ipc_dir, "worker"), bind=False)
    from_worker = zmq_socket(ctx, zmq.PULL, endpoint(ipc_dir, "scheduler_w"), bind=True)
    good = m.ForwardReq(
        slot=0, input_ids=m.pack_ids(list(range(1, 9))), start_pos=0,
        new_pages=m.pack_ids(list(range(1, 9))), new_slot=True,
        sampling=m.SamplingParams(temperature=0.0),
    )  # fmt: skip
    bad = m.ForwardReq(slot=99, input_ids=m.pack_ids([1]), start_pos=0, new_slot=True)
    # both wait in the worker's inbox before it reads anything (ZeroMQ queues on connect)
    to_worker.send(m.encode(m.ForwardBatch(step=0, reqs=[good])))
    to_worker.send(m.encode(m.ForwardBatch(step=1, reqs=[bad])))
    proc = spawn_child("radix_runtime.worker.main", {"args": args.to_json(), "ipc_dir": ipc_dir})
    try:
        got = []
        while len(got) < 3 and from_worker.poll(120_000):
            got.append(m.decode(from_worker.recv()))
            if isinstance(got[-1], m.FatalError):
                break
        kinds = [type(x).__name__ for x in got]
        assert kinds == ["WorkerReady", "ForwardResult", "FatalError"], kinds
        assert got[1].step == 0 and got[1].results[0].next_id >= 0
        assert "slot 99" in got[2].message
        assert proc.wait(30) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)
        shutil.rmtree(ipc_dir, ignore_errors=True)
