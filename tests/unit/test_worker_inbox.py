"""The worker's inbox (worker/main.py `Inbox`): while a step is collected, host-tier copies sent on
their own (HostCopies) are made at once; anything else waits, and so does every message after
it, so the order the scheduler sent them in holds (a batch's copies and a later HostCopies'
loads may name the same device page)."""

from __future__ import annotations

from radix_runtime import messages as m
from radix_runtime.worker.main import Inbox


class FakeSocket:
    def __init__(self, frames):
        self.frames = list(frames)

    def poll(self, timeout_ms=0):
        return len(self.frames)

    def recv(self):
        return self.frames.pop(0)


class Step:
    """Done after `polls` readiness checks."""

    def __init__(self, polls):
        self.polls = polls

    def ready(self):
        self.polls -= 1
        return self.polls < 0


class Runner:
    def __init__(self):
        self.made = []

    def early_copies(self, msg):
        self.made.append(m.unpack_ids(msg.load_dst).tolist())


def copies(page):
    return m.HostCopies(load_src=m.pack_ids([page]), load_dst=m.pack_ids([page]))


def test_copies_are_made_while_a_step_runs_and_other_messages_keep_their_order():
    batch = m.ForwardBatch(step=7, reqs=[])
    frames = [m.encode(copies(3)), b"junk", m.encode(copies(4)), m.encode(batch),
              m.encode(copies(5))]  # fmt: skip
    inbox, runner = Inbox(FakeSocket(frames)), Runner()
    inbox.copies_while(Step(polls=100), runner)
    # the copies before the batch went out at once (the junk frame is dropped); the batch stops
    # the reading, and the copies after it wait behind it
    assert runner.made == [[3], [4]]
    assert inbox.poll()
    got = inbox.recv()
    assert isinstance(got, m.ForwardBatch) and got.step == 7
    assert m.unpack_ids(inbox.recv().load_dst).tolist() == [5]
    assert not inbox.poll()


def test_a_finished_step_stops_the_reading():
    inbox, runner = Inbox(FakeSocket([m.encode(copies(3))])), Runner()
    inbox.copies_while(Step(polls=0), runner)
    assert runner.made == [] and isinstance(inbox.recv(), m.HostCopies)
