"""`--tp 2` end to end on the CPU (gloo): the real processes (tokenizer, one scheduler, two
worker ranks) give --tp 1's greedy tokens, and its logprobs to float32 rounding, for a batch
(prompts split into prefill chunks, the overlap schedule on: the default) and again from the
radix cache; --tp 1 runs with the cache off, so the cache on and off give the same tokens
across the two. Killing one rank mid-request tears everything down.

One --tp 2 server serves the module (its last test kills it).

The model is the shipped tiny-llama config with dummy weights: every rank slices the values
--tp 1 draws (worker/loader.py `dummy_weights`), so the two runs compute the same model.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest
from server_support import start_server

from radix_runtime import Engine

pytestmark = pytest.mark.slow

MODEL = dict(model="tiny-llama", load_format="dummy", model_config="tiny-llama")
FLAGS = dict(max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=16, page_size=2)
SHARED = [(7 * i) % 900 + 3 for i in range(24)]  # a shared 24-token prefix
PROMPTS = [SHARED + [100 + i, 200 + i, 300 + i] * (1 + i) for i in range(4)]  # 27..36 tokens
SAMPLING = {"max_new_tokens": 8, "temperature": 0}
LOGPROBS = dict(return_logprob=True, top_logprobs_num=3, logprob_start_len=0)


def _generate(engine: Engine) -> list[dict]:
    return engine.generate(input_ids=PROMPTS, sampling_params=SAMPLING, **LOGPROBS)


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    with Engine(**MODEL, **FLAGS, tp=1, disable_radix_cache=True) as engine:
        return _generate(engine)


@pytest.fixture(scope="module")
def tp2_server(tmp_path_factory):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**MODEL, **FLAGS}.items()]
    server = start_server(str(tmp_path_factory.mktemp("tp2")), *flags, "--tp", "2")
    yield server
    server.stop()


def _assert_same(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        gm, wm = g["meta_info"], w["meta_info"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert [t for _, t in gm[key]] == [t for _, t in wm[key]]
            assert [lp for lp, _ in gm[key][1:]] == pytest.approx(
                [lp for lp, _ in wm[key][1:]], abs=1e-4
            )
        for g_top, w_top in zip(gm["output_top_logprobs"], wm["output_top_logprobs"]):
            assert [t for _, t in g_top] == [t for _, t in w_top]
            assert [lp for lp, _ in g_top] == pytest.approx([lp for lp, _ in w_top], abs=1e-4)


def test_tp2_equals_tp1_with_the_radix_cache(reference, tp2_server):
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in reference)  # its cache is off
    with tp2_server.client() as c:
        first = c.post("/generate", json={"input_ids": PROMPTS, "sampling_params": SAMPLING,
                                          **LOGPROBS})  # fmt: skip
        assert first.status_code == 200, first.text
        _assert_same(first.json(), reference)
        # the prompts' pages are cached now (prompt logprobs would recompute them: none asked)
        again = [
            c.post("/generate", json={"input_ids": p, "sampling_params": SAMPLING}) for p in PROMPTS
        ]
    assert [r.status_code for r in again] == [200] * len(PROMPTS)
    assert [r.json()["output_ids"] for r in again] == [o["output_ids"] for o in reference]
    assert all(r.json()["meta_info"]["cached_tokens"] >= len(SHARED) for r in again)


def _ranks(server) -> dict[str, psutil.Process]:
    found = {}
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        title = " ".join(child.cmdline())
        for role in ("scheduler", "worker_tp1", "worker"):
            if f"radix_runtime::{role}" in title:
                found[role] = child
                break
    return found


def test_a_dead_rank_ends_the_server(tp2_server):
    server = tp2_server
    procs = _ranks(server)
    assert set(procs) == {"scheduler", "worker", "worker_tp1"}
    # a long request in flight, then rank 1 dies: an error comes back, nothing hangs
    answer: dict = {}

    def long_request() -> None:
        body = {"input_ids": PROMPTS[0], "sampling_params": {**SAMPLING,
                "max_new_tokens": 4000, "ignore_eos": True}}  # fmt: skip
        try:
            answer["r"] = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        except httpx.HTTPError as exc:
            answer["r"] = exc

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    time.sleep(1.0)
    procs["worker_tp1"].send_signal(signal.SIGKILL)
    saw_503 = False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not saw_503:
        try:
            saw_503 = httpx.get(f"{server.url}/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            break  # already gone
        time.sleep(0.05)
    assert saw_503, "/health did not answer 503 after a rank died"
    thread.join(30)
    assert isinstance(answer.get("r"), httpx.Response), answer
    assert answer["r"].status_code == 503
    assert server.proc.wait(30) != 0
    _, alive = psutil.wait_procs(list(procs.values()), timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
