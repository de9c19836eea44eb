"""The real TokenizerManager behind a fake transport: a scripted scheduler on the other end of
its ZeroMQ sockets (the same ipc endpoints, the same msgspec frames), so what is tested is the
manager's own detokenization, stop handling, logprob unpacking, cached-token reporting, aborts,
failures — and the drain of server/run.py's DrainingServer in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket

import httpx
import msgspec
import pytest
import uvicorn
import zmq
import zmq.asyncio

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.frontend.contract import GenerateInput
from radix_runtime.frontend.errors import GenerationError
from radix_runtime.server.http_server import build_app
from radix_runtime.server.run import DrainingServer
from radix_runtime.server.tokenizer_manager import TokenizerManager
from radix_runtime.tokenizer import byte_tokenizer
from radix_runtime.utils.procs import endpoint, zmq_socket

TIMEOUT = 10.0  # seconds any single wait may take before the test fails (never a speed bound)


class FakeScheduler:
    """The scheduler's ends of the manager's sockets: PULL on `scheduler`, PUSH to `tokenizer`."""

    def __init__(self, ipc_dir: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.inbox = zmq_socket(self.ctx, zmq.PULL, endpoint(ipc_dir, "scheduler"), bind=True)
        self.outbox = zmq_socket(self.ctx, zmq.PUSH, endpoint(ipc_dir, "tokenizer"), bind=False)

    async def send(self, msg) -> None:
        await self.outbox.send(m.encode(msg))

    async def send_raw(self, frame: bytes) -> None:
        await self.outbox.send(frame)

    async def recv(self):
        return m.decode(await asyncio.wait_for(self.inbox.recv(), TIMEOUT))

    async def recv_kind(self, kind):
        """The next message of `kind`, skipping others (e.g. the metrics a scrape asks for)."""
        while True:
            msg = await self.recv()
            if isinstance(msg, kind):
                return msg

    async def out(self, rid: str, text: str = "", ids: list[int] | None = None, **kw) -> None:
        """One step's output for `rid`: `text` as byte tokens (the byte tokenizer's ids)."""
        ids = list(text.encode()) if ids is None else ids
        await self.send(
            m.BatchOutput(outputs=[m.ReqOutput(rid=rid, new_ids=m.pack_ids(ids), **kw)])
        )

    def close(self) -> None:
        self.inbox.close(0)
        self.outbox.close(0)
        self.ctx.term()


READY = m.SchedulerReady(
    max_total_tokens=4096, page_size=1, context_length=2048, vocab_size=259, max_running_requests=8
)


@contextlib.asynccontextmanager
async def started(tmp_path, **flags):
    """A started TokenizerManager (byte tokenizer) and the fake scheduler it talks to."""
    args = ServerArgs(**flags)
    manager = TokenizerManager(args, byte_tokenizer(), "fake-model", "/nowhere", str(tmp_path))
    sched = FakeScheduler(str(tmp_path))
    try:
        await sched.send(READY)
        await asyncio.wait_for(manager.start(), TIMEOUT)
        yield manager, sched
    finally:
        await manager.close()
        sched.close()


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 60))


def inp(text: str = "hi", **kw) -> GenerateInput:
    kw.setdefault("sampling", m.SamplingParams(temperature=0.0, max_new_tokens=16))
    return GenerateInput(rid=kw.pop("rid", "r1"), input_ids=list(text.encode()), **kw)


async def collect(agen) -> list:
    return [chunk async for chunk in agen]


def test_start_reads_the_schedulers_limits(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, _):
            assert manager.healthy
            assert (manager.context_length, manager.vocab_size, manager.max_total_tokens) == (
                2048,
                259,
                4096,
            )

    run(main())


def test_a_generation_streams_utf8_safe_text_and_reports_the_schedulers_counts(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, sched):
            task = asyncio.create_task(collect(manager.generate(inp("héllo"))))
            req = await sched.recv_kind(m.GenerateReq)
            assert req.rid == "r1"
            assert m.unpack_ids(req.input_ids).tolist() == list("héllo".encode())
            assert req.sampling.max_new_tokens == 16
            e_acute = "é".encode()  # two byte tokens: the text waits for the second
            await sched.out("r1", "ab", prompt_tokens=6, cached_tokens=3)
            await sched.out("r1", ids=[e_acute[0]], prompt_tokens=6, cached_tokens=3)
            await sched.out("r1", ids=[e_acute[1]], prompt_tokens=6, cached_tokens=3)
            await sched.out("r1", "!", finish_reason="length", prompt_tokens=6, cached_tokens=3)
            chunks = await asyncio.wait_for(task, TIMEOUT)
            texts = [c.text for c in chunks]
            assert "".join(texts) == "abé!"
            assert "\ufffd" not in "".join(texts)  # never half a character
            assert all(c.text != e_acute[:1].decode(errors="replace") for c in chunks)
            last = chunks[-1]
            assert last.finish_reason == "length"
            assert (last.prompt_tokens, last.cached_tokens, last.completion_tokens) == (6, 3, 5)
            assert [i for c in chunks for i in c.ids] == list("abé!".encode())
            assert manager.num_inflight == 0

    run(main())


def test_a_stop_string_trims_the_text_and_aborts_in_the_scheduler(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, sched):
            task = asyncio.create_task(collect(manager.generate(inp(stop=["END"]))))
            await sched.recv_kind(m.GenerateReq)
            await sched.out("r1", "one E")
            await sched.out("r1", "ND two")
            chunks = await asyncio.wait_for(task, TIMEOUT)
            assert "".join(c.text for c in chunks) == "one "
            assert chunks[-1].finish_reason == "stop" and chunks[-1].matched_stop == "END"
            abort = await sched.recv_kind(m.AbortReq)
            assert abort.rid == "r1"

    run(main())


def _lps(text: str, base: float) -> dict:
    """Logprobs for the byte tokens of `text`: base, base - 1, ... (so each names its token)."""
    n = len(text.encode())
    return {"output_logprobs": m.pack_floats([base - i for i in range(n)])}


@pytest.mark.parametrize("stream_cut", ["one E|ND two", "one |END two", "one EN|D| two"])
def test_a_trimmed_stop_strings_tokens_are_not_counted_or_given_logprobs(tmp_path, stream_cut):
    """However the scheduler's steps cut the text, the tokens of "END" and after are neither in
    completion_tokens nor in the logprobs, and no chunk ever carries them (a stream and a
    collected response agree)."""

    async def main():
        async with started(tmp_path) as (manager, sched):
            gen = manager.generate(inp(stop=["END"], return_logprob=True))
            task = asyncio.create_task(collect(gen))
            await sched.recv_kind(m.GenerateReq)
            base = 0.0
            for part in stream_cut.split("|"):
                await sched.out("r1", part, **_lps(part, base))
                base -= len(part)
            chunks = await asyncio.wait_for(task, TIMEOUT)
            assert "".join(c.text for c in chunks) == "one "
            assert [i for c in chunks for i in c.ids] == list(b"one ")
            assert [lp for c in chunks for lp in c.output_logprobs] == [0.0, -1.0, -2.0, -3.0]
            assert chunks[-1].completion_tokens == 4
            assert chunks[-1].finish_reason == "stop"

    run(main())


def test_text_held_for_a_stop_string_that_never_completes_is_counted(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, sched):
            gen = manager.generate(inp(stop=["END"], return_logprob=True))
            task = asyncio.create_task(collect(gen))
            await sched.recv_kind(m.GenerateReq)
            await sched.out("r1", "ab E", **_lps("ab E", 0.0))
            await sched.out("r1", "N", **_lps("N", -4.0), finish_reason="length")
            chunks = await asyncio.wait_for(task, TIMEOUT)
            assert "".join(c.text for c in chunks) == "ab EN"
            assert [lp for c in chunks for lp in c.output_logprobs] == [0.0, -1.0, -2.0, -3.0, -4.0]
            assert chunks[-1].completion_tokens == 5
            # the first chunk released "ab " with its three tokens, holding "E" back
            assert chunks[0].ids == list(b"ab ")

    run(main())


def test_a_stop_token_is_not_part_of_the_text(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, sched):
            task = asyncio.create_task(collect(manager.generate(inp())))
            await sched.recv_kind(m.GenerateReq)
            eos = 258  # <|im_end|>
            await sched.out(
                "r1", ids=[ord("o"), ord("k"), eos], finish_reason="stop", matched_stop=eos
            )
            chunks = await asyncio.wait_for(task, TIMEOUT)
            assert "".join(c.text for c in chunks) == "ok"
            assert chunks[-1].matched_stop == eos and chunks[-1].completion_tokens == 3

    run(main())


def test_logprobs_are_unpacked_per_token(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, sched):
            request = inp(return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
            task = asyncio.create_task(collect(manager.generate(request)))
            req = await sched.recv_kind(m.GenerateReq)
            assert (req.return_logprob, req.top_logprobs_num, req.logprob_start_len) == (True, 2, 0)
            await sched.out(
                "r1",
                "ab",
                finish_reason="length",
                output_logprobs=m.pack_floats([-0.5, -0.25]),
                top_ids=m.pack_ids([97, 98, 98, 99]),
                top_logprobs=m.pack_floats([-0.5, -1.0, -0.25, -2.0]),
                prompt_logprobs=m.pack_floats([-3.0]),
                prompt_logprob_start=1,
            )
            (chunk,) = await asyncio.wait_for(task, TIMEOUT)
            assert chunk.output_logprobs == [-0.5, -0.25]
            assert chunk.output_top_logprobs == [
                [(97, -0.5), (98, -1.0)],
                [(98, -0.25), (99, -2.0)],
            ]
            assert chunk.prompt_logprobs == [-3.0]

    run(main())


@pytest.mark.parametrize("code,status", [("kv_cache_too_small", 400), ("server_error", 503)])
def test_a_scheduler_error_becomes_a_generation_error(tmp_path, code, status):
    async def main():
        async with started(tmp_path) as (manager, sched):
            task = asyncio.create_task(collect(manager.generate(inp())))
            await sched.recv_kind(m.GenerateReq)
            await sched.out("r1", ids=[], finish_reason="error", error="no room", error_code=code)
            with pytest.raises(GenerationError) as info:
                await asyncio.wait_for(task, TIMEOUT)
            assert (info.value.code, info.value.status) == (code, status)
            assert "no room" in str(info.value)
            assert manager.num_inflight == 0

    run(main())


def test_a_consumer_that_goes_away_aborts_its_request(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, sched):
            agen = manager.generate(inp())
            first = asyncio.create_task(agen.__anext__())
            await sched.recv_kind(m.GenerateReq)
            await sched.out("r1", "a")
            assert (await asyncio.wait_for(first, TIMEOUT)).text == "a"
            await agen.aclose()  # the client disconnected
            assert (await sched.recv_kind(m.AbortReq)).rid == "r1"
            assert manager.num_inflight == 0

    run(main())


def test_a_duplicate_request_id_is_refused(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, sched):
            task = asyncio.create_task(collect(manager.generate(inp(rid="same"))))
            await sched.recv_kind(m.GenerateReq)
            with pytest.raises(GenerationError) as info:
                await collect(manager.generate(inp(rid="same")))
            assert info.value.code == "duplicate_request_id" and info.value.status == 400
            await sched.out("same", "x", finish_reason="length")
            await asyncio.wait_for(task, TIMEOUT)

    run(main())


def test_server_info_reports_zero_counters_too(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, sched):
            task = asyncio.create_task(manager.server_info())
            await sched.recv_kind(m.ServerInfoReq)
            cache = m.CacheStats(
                total_pages=10, free_pages=10, evictable_pages=0, protected_pages=0,
                page_size=1, hit_rate=0.0,
            )  # fmt: skip
            await sched.send(
                m.ServerInfo(
                    cache=cache, running_requests=0, waiting_requests=0, max_total_tokens=10,
                    max_running_requests=8, context_length=2048, vocab_size=259,
                )
            )  # fmt: skip
            info = await asyncio.wait_for(task, TIMEOUT)
            assert info["retractions"] == 0 and info["decode_steps"] == 0
            assert info["cache"]["total_pages"] == 10

    run(main())


def test_a_malformed_frame_is_dropped_and_the_manager_keeps_working(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, sched):
            await sched.send_raw(b"\x00garbage")
            await sched.send_raw(msgspec.msgpack.encode({"type": "nope"}))
            task = asyncio.create_task(collect(manager.generate(inp())))
            await sched.recv_kind(m.GenerateReq)
            await sched.out("r1", "fine", finish_reason="length")
            chunks = await asyncio.wait_for(task, TIMEOUT)
            assert "".join(c.text for c in chunks) == "fine"
            assert manager.healthy

    run(main())


def test_a_fatal_error_fails_what_runs_and_refuses_new_work(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, sched):
            fatal = []
            manager.on_fatal = fatal.append
            task = asyncio.create_task(collect(manager.generate(inp())))
            await sched.recv_kind(m.GenerateReq)
            await sched.send(m.FatalError(role="worker", message="CUDA error"))
            with pytest.raises(GenerationError) as info:
                await asyncio.wait_for(task, TIMEOUT)
            assert info.value.status == 503 and "CUDA error" in str(info.value)
            assert not manager.healthy and fatal and "CUDA error" in fatal[0]
            with pytest.raises(GenerationError) as info:
                await collect(manager.generate(inp(rid="r2")))
            assert info.value.code == "unhealthy" and "CUDA error" in info.value.message

    run(main())


# ---------------------------------------------------------------------------------------------
# server/run.py's drain, over real HTTP, in front of the real manager


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def draining_server(tmp_path, drain_timeout: float):
    async with started(tmp_path, disable_metrics=True) as (manager, sched):
        args = ServerArgs(port=_free_port(), drain_timeout=drain_timeout, disable_metrics=True)
        config = uvicorn.Config(
            build_app(manager, args), host="127.0.0.1", port=args.port, log_level="warning",
            loop="none", timeout_graceful_shutdown=2,
        )  # fmt: skip
        server = DrainingServer(config, manager, drain_timeout)
        server.loop = asyncio.get_running_loop()
        serving = asyncio.create_task(server.serve())
        while not server.started:
            assert not serving.done(), "uvicorn did not start"
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{args.port}", timeout=TIMEOUT
        ) as c:
            yield manager, sched, server, serving, c
        server.should_exit = True
        await asyncio.wait_for(serving, TIMEOUT)


GENERATE = {"input_ids": [104, 105], "sampling_params": {"max_new_tokens": 8}, "stream": True}


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tmp_path):
    async def main():
        async with draining_server(tmp_path, drain_timeout=30) as (
            manager,
            sched,
            server,
            serving,
            c,
        ):
            first_event = asyncio.Event()

            async def stream() -> list[str]:
                lines = []
                async with c.stream("POST", "/generate", json=GENERATE) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        lines.append(line)
                        if line.startswith("data:"):
                            first_event.set()
                return lines

            streaming = asyncio.create_task(stream())
            req = await sched.recv_kind(m.GenerateReq)
            await sched.out(req.rid, "a")
            await asyncio.wait_for(first_event.wait(), TIMEOUT)
            server.handle_exit(signal.SIGTERM, None)
            assert manager.draining
            refused = await c.post("/generate", json={**GENERATE, "stream": False})
            assert refused.status_code == 503
            assert (await c.get("/health")).status_code == 503
            assert not serving.done()  # the in-flight request keeps the server up
            await sched.out(req.rid, "b", finish_reason="length")
            body = "\n".join(await asyncio.wait_for(streaming, TIMEOUT))
            assert '"finish_reason"' in body and "[DONE]" in body and "error" not in body
            await asyncio.wait_for(serving, TIMEOUT)  # drained: the server exits by itself
            assert manager.num_inflight == 0

    run(main())


def test_what_outlives_the_drain_timeout_gets_a_503_error(tmp_path):
    async def main():
        async with draining_server(tmp_path, drain_timeout=0.3) as (
            manager,
            sched,
            server,
            serving,
            c,
        ):
            task = asyncio.create_task(c.post("/generate", json={**GENERATE, "stream": False}))
            await sched.recv_kind(m.GenerateReq)  # the request is in flight and never finishes
            server.handle_exit(signal.SIGTERM, None)
            resp = await asyncio.wait_for(task, TIMEOUT)
            assert resp.status_code == 503
            assert "--drain-timeout (0.3s) expired" in resp.json()["error"]["message"]
            await asyncio.wait_for(serving, TIMEOUT)

    run(main())


def test_sigint_exits_at_once_without_draining(tmp_path):
    async def main():
        async with draining_server(tmp_path, drain_timeout=30) as (manager, _, server, serving, _c):
            server.handle_exit(signal.SIGINT, None)
            assert not manager.draining and server.should_exit
            await asyncio.wait_for(serving, TIMEOUT)

    run(main())


def test_a_receive_loop_that_fails_is_fatal_not_a_hang(tmp_path):
    async def main():
        async with started(tmp_path) as (manager, sched):
            task = asyncio.create_task(collect(manager.generate(inp())))
            await sched.recv_kind(m.GenerateReq)

            def broken(*args):  # a bug in what the loop does with a frame
                raise RuntimeError("bug")

            manager.metrics.on_tokens = broken
            await sched.out("r1", "a")
            with pytest.raises(GenerationError) as info:
                await asyncio.wait_for(task, TIMEOUT)
            assert info.value.status == 503 and "receive loop" in info.value.message
            assert manager.serving_error().code == "unhealthy"

    run(main())
