"""The scheduler's per-step debug line (`--log-level debug`): what each step held and cost, and
whose first token it produced; a multi-turn TTFT diagnosis reads it from a server log."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.scheduler.main import SchedulerProcess
from radix_runtime.scheduler.request import Req
from radix_runtime.scheduler.scheduler import PlannedReq


def test_step_line(tmp_path, caplog):
    proc = SchedulerProcess(ServerArgs(), str(tmp_path))
    try:
        proc.scheduler = SimpleNamespace(waiting=[object(), object()])
        sp = m.SamplingParams()
        fresh = Req(rid="a", prompt=np.arange(5, dtype=np.int32), sampling=sp, arrival=0)
        chunk = Req(rid="b", prompt=np.arange(9, dtype=np.int32), sampling=sp, arrival=1)
        decoding = Req(rid="c", prompt=np.arange(3, dtype=np.int32), sampling=sp, arrival=2)
        decoding.output_ids = [7]
        plan = [
            PlannedReq(fresh, 5, True),
            PlannedReq(chunk, 4, False),
            PlannedReq(decoding, 1, True),
        ]
        result = m.ForwardResult(step=3, results=[], forward_s=0.012)
        with caplog.at_level(logging.DEBUG, logger="radix_runtime.scheduler"):
            proc._log_step(m.ForwardBatch(step=3, reqs=[]), plan, result, 0.0125)
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith("step 3: 2 prefill rows (9 tokens), 1 decode rows")
        assert "worker 12.00 ms, step 12.50 ms; 2 waiting; first tokens for ['a']" in line
    finally:
        proc.ctx.destroy(linger=0)
