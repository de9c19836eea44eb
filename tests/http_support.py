"""An HTTP server without a model: the real app (build_app) over the real TokenizerManager, with
a scripted scheduler on the other end of the manager's ZeroMQ sockets (the same ipc endpoints,
the same msgspec frames). What the tests see is the product's HTTP layer, validation, renderers,
detokenization, stop strings, logprobs and aborts; only the model's answer is scripted.

    with served(api_key="k") as s:
        s.client.post(...); s.manager.inputs; s.sched.requests; s.sched.fail = ("why", "code")
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import threading
from dataclasses import dataclass

import zmq
from fastapi.testclient import TestClient

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.frontend.contract import GenerateInput
from radix_runtime.server.http_server import build_app
from radix_runtime.server.tokenizer_manager import TokenizerManager
from radix_runtime.utils.procs import endpoint, zmq_socket

MODEL = "fake-model"
VOCAB = 1000
CONTEXT = 64
BOS, EOS = 1, 2
REPLY = "Hello world"
CACHED = 3  # the cached prompt tokens the scheduler reports for every request
OUTPUT_LOGPROB, PROMPT_LOGPROB = -0.5, -1.0


class FakeTokenizer:
    """One token per character (its code point); ids < 3 are special."""

    eos_token_ids = [EOS]
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) if ord(c) < VOCAB else 999 for c in text]
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], **kw) -> str:
        return "".join(chr(i) for i in ids if i >= 3)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw) -> str:
        text = ""
        for msg in messages:
            if "BAD" in msg["content"]:
                raise ValueError("the template refused this conversation")
            text += f"<{msg['role']}>{msg['content']}"
        return text + ("<a>" if add_generation_prompt else "")


class ScriptedScheduler:
    """The scheduler's ends of the manager's sockets, served from a thread. Every GenerateReq is
    answered as the scheduler answers a model that always says REPLY then EOS: one BatchOutput
    per token, ``finish_reason`` "length" at max_new_tokens or "stop" (matched EOS) at the EOS,
    CACHED cached tokens, OUTPUT_LOGPROB per output token (top-k: the token, then the next ids),
    PROMPT_LOGPROB per prompt position asked for. It records what reaches it.

    ``hang``: never answer (a request stuck in the queue); ``hang_after_first``: one token, then
    nothing; ``fail``: (message, code) instead of any token; ``fail_after_first``: one token,
    then that error; ``garbage``: a token buffer that is not int32 (a bug on the other side).
    """

    def __init__(self, ipc_dir: str) -> None:
        self.ctx = zmq.Context()
        self.inbox = zmq_socket(self.ctx, zmq.PULL, endpoint(ipc_dir, "scheduler"), bind=True)
        self.outbox = zmq_socket(self.ctx, zmq.PUSH, endpoint(ipc_dir, "tokenizer"), bind=False)
        self.reset()
        self._stop = threading.Event()
        self.send(
            m.SchedulerReady(
                max_total_tokens=4096,
                page_size=1,
                context_length=CONTEXT,
                vocab_size=VOCAB,
                max_running_requests=8,
            )
        )
        self._thread = threading.Thread(target=self._serve, name="scripted-scheduler")
        self._thread.start()

    def reset(self) -> None:
        self.requests: list[m.GenerateReq] = []
        self.aborted: list[str] = []
        self.hang = self.hang_after_first = self.garbage = False
        self.fail: tuple[str, str] | None = None
        self.fail_after_first: tuple[str, str] | None = None
        self.flush_ok = True

    def send(self, msg) -> None:
        self.outbox.send(m.encode(msg))

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.inbox.poll(20):
                continue
            msg = m.decode(self.inbox.recv())
            if isinstance(msg, m.GenerateReq):
                self.requests.append(msg)
                self._answer(msg)
            elif isinstance(msg, m.AbortReq):
                self.aborted.append(msg.rid)
            elif isinstance(msg, m.ServerInfoReq):
                self.send(self.server_info())
            elif isinstance(msg, m.FlushCacheReq):
                self.send(
                    m.FlushCacheDone(
                        ok=self.flush_ok,
                        message="" if self.flush_ok else "busy",
                        dropped_nodes=2,
                        dropped_pages=5,
                        dropped_tokens=5,
                        kept_pages=1,
                    )
                )

    @staticmethod
    def server_info() -> m.ServerInfo:
        cache = m.CacheStats(
            total_pages=64,
            free_pages=60,
            evictable_pages=2,
            protected_pages=2,
            page_size=1,
            hit_rate=0.5,
        )
        return m.ServerInfo(
            cache=cache,
            running_requests=0,
            waiting_requests=0,
            max_total_tokens=4096,
            max_running_requests=8,
            context_length=CONTEXT,
            vocab_size=VOCAB,
        )

    def _answer(self, req: m.GenerateReq) -> None:
        if self.hang:
            return
        if self.fail is not None:
            self._error(req.rid, *self.fail)
            return
        prompt = m.unpack_ids(req.input_ids).tolist()
        budget = req.sampling.max_new_tokens
        tokens = [ord(c) for c in REPLY] + [EOS]
        for i, tok in enumerate(tokens[:budget]):
            out = m.ReqOutput(
                rid=req.rid,
                new_ids=b"\x01\x02\x03" if self.garbage else m.pack_ids([tok]),
                prompt_tokens=len(prompt),
                cached_tokens=CACHED,
            )
            if tok == EOS:
                out.finish_reason, out.matched_stop = "stop", EOS
            elif i == budget - 1:
                out.finish_reason = "length"
            if req.return_logprob:
                out.output_logprobs = m.pack_floats([OUTPUT_LOGPROB])
                k = req.top_logprobs_num
                if k:
                    out.top_ids = m.pack_ids([tok + j for j in range(k)])
                    out.top_logprobs = m.pack_floats([OUTPUT_LOGPROB - j for j in range(k)])
            if i == 0:
                self._add_prompt_logprobs(out, req, prompt)
            self._send_outputs(out)
            if i == 0 and self.fail_after_first is not None:
                self._error(req.rid, *self.fail_after_first)
                return
            if self.hang_after_first:
                return
        if budget == 0:  # prefill only
            out = m.ReqOutput(
                rid=req.rid, finish_reason="length", prompt_tokens=len(prompt), cached_tokens=CACHED
            )
            self._add_prompt_logprobs(out, req, prompt)
            self._send_outputs(out)

    @staticmethod
    def _add_prompt_logprobs(out: m.ReqOutput, req: m.GenerateReq, prompt: list[int]) -> None:
        """Positions max(logprob_start_len, 1).. (position 0 has no logprob); top-k: the prompt's
        own token first, then made-up alternatives."""
        if not req.return_logprob or req.logprob_start_len < 0:
            return
        first = max(req.logprob_start_len, 1)
        out.prompt_logprob_start = first
        out.prompt_logprobs = m.pack_floats([PROMPT_LOGPROB] * (len(prompt) - first))
        k = req.top_logprobs_num
        if k:
            ids = [tok + j for tok in prompt[first:] for j in range(k)]
            lps = [PROMPT_LOGPROB - j for _ in prompt[first:] for j in range(k)]
            out.prompt_top_ids, out.prompt_top_logprobs = m.pack_ids(ids), m.pack_floats(lps)

    def _send_outputs(self, out: m.ReqOutput) -> None:
        self.send(m.BatchOutput(outputs=[out]))

    def _error(self, rid: str, message: str, code: str) -> None:
        self._send_outputs(
            m.ReqOutput(rid=rid, finish_reason="error", error=message, error_code=code)
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.inbox.close(0)
        self.outbox.close(0)
        self.ctx.term()


class RecordingManager(TokenizerManager):
    """The real TokenizerManager, recording the inputs the front hands it (what the tests check
    of the front's validation: stop strings and skip_special_tokens never reach the wire)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.inputs: list[GenerateInput] = []

    def generate(self, inp: GenerateInput):
        self.inputs.append(inp)
        return super().generate(inp)


def new_manager_for(ipc_dir: str) -> RecordingManager:
    """Not started yet: the app's lifespan (or the test) starts it on the loop that serves."""
    return RecordingManager(ServerArgs(), FakeTokenizer(), MODEL, "/models/fake", ipc_dir)


@contextlib.asynccontextmanager
async def running(manager: TokenizerManager):
    await asyncio.wait_for(manager.start(), 10)
    try:
        yield  # (no lifespan state)
    finally:
        await manager.close()


def app_for(manager: TokenizerManager, **args):
    return build_app(manager, ServerArgs(**args), lifespan=lambda app: running(manager))


@contextlib.contextmanager
def make_client(manager: TokenizerManager, **args):
    with TestClient(app_for(manager, **args), raise_server_exceptions=False) as client:
        yield client


@dataclass
class Served:
    client: TestClient
    manager: RecordingManager
    sched: ScriptedScheduler


@contextlib.contextmanager
def served(**args):
    """A started app over a manager and scheduler of its own (``args``: ServerArgs flags)."""
    with tempfile.TemporaryDirectory(prefix="rr-http-") as ipc_dir:
        sched = ScriptedScheduler(ipc_dir)
        try:
            manager = new_manager_for(ipc_dir)
            with make_client(manager, **args) as client:
                yield Served(client, manager, sched)
        finally:
            sched.close()


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


def assert_error(resp, status: int, param=None, code=None, type_="invalid_request_error"):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == type_
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def sse_events(text: str) -> list:
    """Parse an SSE body; every event must be a single `data:` line followed by a blank line."""
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    return events[:-1]
