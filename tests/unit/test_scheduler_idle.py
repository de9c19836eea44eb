"""The scheduler loop's idle path: it blocks on its sockets, and its integrity check (which walks
the whole pool) waits for a quiet moment instead of sitting in front of a request that arrives
right after the previous answer. Driven with a fake clock and scripted inputs: no timing."""

from __future__ import annotations

import test_scheduler as ts

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs, auto_max_running_requests
from radix_runtime.scheduler import main as sched_main
from radix_runtime.scheduler.main import IdleCheck, SchedulerProcess
from radix_runtime.scheduler.scheduler import Scheduler


def test_idle_check_waits_for_quiet():
    check = IdleCheck(grace_s=0.05)
    assert not check.due(0.0) and check.wait_ms(0.0) == IdleCheck.IDLE_POLL_MS  # nothing ran
    check.stepped()
    assert not check.due(1.0)  # just became idle: the quiet period starts
    assert check.wait_ms(1.0) == 50 and check.wait_ms(1.03) == 20
    check.busy()  # a request came: the quiet period starts again when idle again
    assert not check.due(1.06)
    assert not check.due(1.1) and check.due(1.11)
    check.checked()
    assert not check.due(5.0) and check.wait_ms(5.0) == IdleCheck.IDLE_POLL_MS  # once per idle


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_a_request_right_after_an_answer_is_not_held_by_the_check(tmp_path, monkeypatch):
    """Request b arrives in the turn after a's answer went out: it is scheduled at once, with no
    integrity check between a's answer and b's step; once the scheduler has been idle for the
    grace period, the check runs exactly once. The idle loop blocks (polls with a timeout)."""
    args = ServerArgs(max_total_tokens=256, radix_tree_impl="python")
    proc = SchedulerProcess(args, str(tmp_path))
    clock = _Clock()
    monkeypatch.setattr(sched_main.time, "monotonic", clock.monotonic)
    events: list = []
    try:
        worker = ts.FakeWorker(257, 1, auto_max_running_requests(256))
        sched = proc.scheduler = Scheduler(args, worker.ready())
        checks = sched.check_integrity

        def check_integrity() -> None:
            events.append("check")
            checks()

        sched.check_integrity = check_integrity
        proc.send_tok = lambda msg: events.append(
            ("out", [o.rid for o in msg.outputs]) if isinstance(msg, m.BatchOutput) else msg
        )
        proc.send_batch = lambda batch, plan: (events.append("step"), worker.forward(batch))[1]
        proc.finish_step = lambda plan, result: sched.process_result(plan, result)

        def request(rid: str) -> m.GenerateReq:
            sampling = m.SamplingParams(max_new_tokens=1)
            return m.GenerateReq(rid=rid, input_ids=m.pack_ids([1, 2, 3, rid == "b"]),
                                 sampling=sampling)  # fmt: skip

        # per loop turn: (the messages that arrive, the clock's advance during the poll)
        script = [([request("a")], 0.0), ([request("b")], 0.001), ([], 0.02), ([], 0.04)]
        waits: list[int] = []

        def drain_inputs(timeout_ms: int, worker: bool) -> None:
            waits.append(timeout_ms)
            if not script:
                proc.running = False
                return
            msgs, advance_s = script.pop(0)
            clock.now += advance_s
            for msg in msgs:
                proc.handle(msg)

        proc.drain_inputs = drain_inputs
        proc.to_worker.send = lambda *a, **k: None  # the ShutdownReq at the end
        proc.loop()
        assert events[:4] == ["step", ("out", ["a"]), "step", ("out", ["b"])]
        assert events[4:] == ["check"]  # after 0.06 s of quiet, once
        assert waits[0] == IdleCheck.IDLE_POLL_MS  # idle before a: blocked on the sockets
        assert 0 < waits[2] <= 50  # idle after b: until the check is due
        assert waits[-1] == IdleCheck.IDLE_POLL_MS  # checked: blocks again
    finally:
        proc.ctx.destroy(linger=0)
