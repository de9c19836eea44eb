"""Engine(dp=N): N in-process replicas (each its own scheduler and worker), generations spread
over them, greedy outputs those of one replica. The tiny dummy model: seconds, not minutes."""

from __future__ import annotations

import random

import psutil
import pytest

from radix_runtime import Engine

pytestmark = pytest.mark.slow

TINY = dict(
    model="tiny-llama",
    load_format="dummy",
    model_config="tiny-llama",
    device="cpu",
    max_total_tokens=4096,
    max_running_requests=8,
)


def prompts(vocab: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(24)]  # a shared prefix, then their own
    return [shared + [rng.randrange(3, vocab) for _ in range(4 + i)] for i in range(count)]


def generate(engine: Engine, batch: list[list[int]]) -> list[list[int]]:
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    return [out["output_ids"] for out in engine.generate(input_ids=batch, sampling_params=greedy)]


def test_two_replicas_answer_and_match_one():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with Engine(**TINY) as one:
        batch = prompts(one.manager.vocab_size)
        expected = generate(one, batch)
        assert "replicas" not in one.server_info()  # one replica: the plain info
    engine = Engine(dp=2, **TINY)
    children = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    try:
        assert len(children) == 4  # a scheduler and a worker per replica
        assert generate(engine, batch) == expected
        replicas = engine.server_info()["replicas"]
        assert [r["dp_rank"] for r in replicas] == [0, 1]
        served = [r["cache"]["prompt_tokens"] for r in replicas]
        assert all(n > 0 for n in served), served  # both replicas answered
        assert sum(served) == sum(map(len, batch))
        # CPU replicas split the cores (each its own share, as serve --dp places them)
        workers = [c for c in children if "worker" in " ".join(c.cmdline())]
        shares = [set(w.cpu_affinity()) for w in workers]
        if len(psutil.Process().cpu_affinity()) >= 2:
            assert shares[0].isdisjoint(shares[1]), shares
        # a dead replica: the other keeps answering, and server_info says which died
        dead = next(c for c in workers if c.cpu_affinity() == list(shares[0]))
        dead.kill()
        psutil.wait_procs([dead], timeout=10)
        for _ in range(50):
            info = engine.server_info()["replicas"]
            if not all(r["healthy"] for r in info):
                break
            psutil.Process().cpu_percent(0.1)  # wait a beat for the watcher (0.2 s)
        assert sorted(r["healthy"] for r in info) == [False, True], info
        assert "exited" in next(r["error"] for r in info if not r["healthy"])
        assert generate(engine, batch[:2]) == expected[:2]
    finally:
        engine.shutdown()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive
