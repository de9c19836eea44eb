"""The HTTP front: FastAPI routes on uvicorn + uvloop.

A generation request goes: auth (middleware) -> serving gate (healthy, not draining) -> body read
with a size cap -> msgspec decode + validation (``protocol``) -> chat template / tokenization ->
one ``GenerateInput`` per choice -> ``_Run`` drives them through ``TokenizerManager.generate``
concurrently -> a renderer shapes JSON or SSE.

A client that goes away is noticed while it waits (streaming or not) and every generation that
has not finished is aborted, so the scheduler unlocks its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from radix_runtime.config import ServerArgs
from radix_runtime.server import protocol as P
from radix_runtime.server.errors import (
    AUTHENTICATION,
    SERVER_ERROR,
    ApiError,
    GenerationError,
    error_body,
    error_response,
    install_error_handlers,
)
from radix_runtime.server.observability import install_observability_routes
from radix_runtime.server.openapi import install_openapi, route_openapi
from radix_runtime.server.tenancy import Tenant, cache_namespace, find_tenant, load_tenants
from radix_runtime.server.tokenize_routes import install_tokenize_routes
from radix_runtime.server.tools import (
    ToolPlan,
    history_for_template,
    plan_tools,
    resolve_parser,
    with_fallback_prompt,
)
from radix_runtime.tokenizer.chat_template import CHATML_TEMPLATE, supports_tools

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def _sse(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


_SSE_DONE = b"data: [DONE]\n\n"
# /health_generate answers 503 when its one token takes longer than this (a stuck worker)
HEALTH_GENERATE_TIMEOUT_S = 30.0

# ---------------------------------------------------------------------------------------------
# running generations


_background: set[asyncio.Task] = set()


def _spawn(coro: Awaitable[Any]) -> None:
    """Fire and forget, keeping a reference; used for aborts, which must run even while the task
    that asks for them is being cancelled."""

    async def run() -> None:
        try:
            await coro
        except Exception:
            logger.exception("background task failed")

    task = asyncio.get_running_loop().create_task(run())
    _background.add(task)
    task.add_done_callback(_background.discard)


class _Run:
    """The generations of one HTTP request, run concurrently; ``next()`` yields their increments
    in arrival order. ``close()`` cancels what is still running and aborts it in the scheduler."""

    def __init__(self, manager: Any, inputs: list[P.GenerateInput]) -> None:
        self.manager = manager
        self.states = [P.ChoiceState(i, inp.rid, inp.input_ids) for i, inp in enumerate(inputs)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._running = len(inputs)
        self._unfinished = {inp.rid for inp in inputs}
        self._tasks = [asyncio.create_task(self._pump(i, inp)) for i, inp in enumerate(inputs)]

    async def _pump(self, index: int, inp: P.GenerateInput) -> None:
        try:
            async for chunk in self.manager.generate(inp):
                self._queue.put_nowait((index, chunk))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
            return
        self._queue.put_nowait((index, None))

    async def next(self) -> tuple[P.ChoiceState, P.GenerateChunk] | None:
        """The next increment of any generation; None once all have finished. Raises the first
        GenerationError."""
        while self._running:
            index, item = await self._queue.get()
            state = self.states[index]
            if item is None:  # this generator is exhausted
                self._running -= 1
                self._unfinished.discard(state.rid)
                if state.finish_reason is None:
                    logger.warning("generation %s ended without a finish reason", state.rid)
                    state.finish_reason = "abort"
                continue
            if isinstance(item, Exception):
                self._running -= 1
                self._unfinished.discard(state.rid)  # the manager already dropped it
                raise item
            state.add(item)
            if item.finish_reason is not None:
                self._unfinished.discard(state.rid)
            return state, item
        return None

    async def collect(self) -> list[P.ChoiceState]:
        while await self.next() is not None:
            pass
        return self.states

    def close(self) -> None:
        """Idempotent, synchronous (safe inside a cancelled task)."""
        for task in self._tasks:
            if not task.done():
                task.cancel()
        for rid in self._unfinished:
            _spawn(self.manager.abort(rid))
        self._unfinished.clear()


class _ClientGone(Exception):
    pass


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, awaitable: Awaitable[Any]) -> Any:
    """Await ``awaitable`` unless the client disconnects first (then cancel it, raise _ClientGone).
    Only call after the body has been read."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    raise _ClientGone


class _SSEResponse(StreamingResponse):
    """Streams while listening for the client's disconnect whatever the ASGI spec version, so a
    client that leaves while the request waits in the queue is noticed before its first token."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    # OSError: the client is gone; the listener sees that too
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            # NOTE: the body generator's own cleanup never runs if it was cancelled before its
            # first step, so the response closes the run too (close is idempotent).
            self.on_close()


# ---------------------------------------------------------------------------------------------
# auth


# where the auth middleware leaves the caller's tenant for the routes (the ASGI scope)
TENANT_SCOPE_KEY = "radix_runtime.tenant"


class _AuthMiddleware:
    """``Authorization: Bearer <key>`` on every route but /health and /dashboard (a static page
    holding no data: it asks for the key and sends it with each of its requests). The tenant
    whose key matched is left in the scope (``TENANT_SCOPE_KEY``) for the cache namespace."""

    OPEN_PATHS = frozenset({"/health", "/dashboard"})

    def __init__(self, app: ASGIApp, tenants: list[Tenant]) -> None:
        self.app = app
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        # NOTE: find_tenant compares with every key, each with hmac.compare_digest
        tenant = find_tenant(self.tenants, given)
        if tenant is not None:
            scope[TENANT_SCOPE_KEY] = tenant
            return await self.app(scope, receive, send)
        err = ApiError(
            "missing or invalid API key (expected 'Authorization: Bearer <key>')",
            status=401,
            code="invalid_api_key",
            type=AUTHENTICATION,
        )
        response = error_response(err, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


# ---------------------------------------------------------------------------------------------
# the routes


class _Api:
    def __init__(self, manager: Any, args: ServerArgs) -> None:
        self.manager = manager
        self.args = args
        self.created = int(time.time())
        self._tool_parser: str | None = None

    @property
    def limits(self) -> P.ModelLimits:
        m = self.manager
        return P.ModelLimits(m.model_name, m.context_length, m.vocab_size)

    # --- request plumbing

    def check_serving(self) -> None:
        if not self.manager.healthy:
            raise ApiError(
                "the server is unhealthy (a child process died)", status=503, code="unhealthy"
            )
        if self.manager.draining:
            raise ApiError("the server is shutting down", status=503, code="draining")

    async def read_body(self, request: Request) -> bytes:
        limit = self.args.max_body_bytes
        too_large = ApiError(
            f"request body is larger than {limit} bytes", status=413, code="request_too_large"
        )
        length = request.headers.get("content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise ApiError("invalid Content-Length header", code="invalid_header") from None
            if declared > limit:
                raise too_large
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise too_large
                parts.append(part)
        except ClientDisconnect:
            raise ApiError("client disconnected while sending the body") from None
        return b"".join(parts)

    async def decode(self, request: Request, type_: type) -> Any:
        self.check_serving()
        return P.decode_request(await self.read_body(request), type_)

    async def respond(
        self, request: Request, inputs: list[P.GenerateInput], renderer: Any, stream: bool
    ) -> Response:
        run = _Run(self.manager, inputs)
        if not stream:
            try:
                states = await _unless_disconnected(request, run.collect())
            except _ClientGone:
                return Response(status_code=499)
            except GenerationError as exc:
                raise exc.to_api_error() from None
            finally:
                run.close()
            return json_response(renderer.response(states))

        # Wait for the first increment before sending headers, so a request the scheduler
        # rejects outright still gets a proper HTTP status.
        try:
            first = await _unless_disconnected(request, run.next())
        except _ClientGone:
            run.close()
            return Response(status_code=499)
        except GenerationError as exc:
            run.close()
            raise exc.to_api_error() from None
        except BaseException:
            run.close()
            raise
        if first is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s: first increment to HTTP", first[0].rid)
        return _SSEResponse(
            self._events(run, first, renderer),
            on_close=run.close,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _events(self, run: _Run, first: Any, renderer: Any):
        try:
            item = first
            while item is not None:
                for payload in renderer.stream_chunk(*item):
                    yield _sse(payload)
                item = await run.next()
            for payload in renderer.stream_end(run.states):
                yield _sse(payload)
        except GenerationError as exc:
            err = exc.to_api_error()
            yield _sse(error_body(err.message, err.type, err.param, err.code))
        except Exception:
            logger.exception("error while streaming")
            yield _sse(error_body("internal server error", SERVER_ERROR, None, "internal_error"))
        finally:
            run.close()
        yield _SSE_DONE

    def namespace(
        self, request: Request | None, req: P._OpenAIRequest | P.NativeGenerateRequest
    ) -> str:
        """The radix tree namespace of this request (server/tenancy.py)."""
        salt = P.cache_salt(req)
        tenant = request.scope.get(TENANT_SCOPE_KEY) if request is not None else None
        return cache_namespace(self.args.cache_isolation, tenant, salt)

    # --- tokenization

    def tokenizer(self, param: str) -> Any:
        tokenizer = self.manager.tokenizer
        if tokenizer is None:
            raise ApiError(
                "this server has no tokenizer (dummy weights): send token ids instead of text",
                param=param,
                code="no_tokenizer",
            )
        return tokenizer

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        tokenizer = self.tokenizer(param)
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt_ids(self, messages: list[dict], tools: ToolPlan | None = None) -> list[int]:
        tokenizer = self.tokenizer("messages")
        template = getattr(tokenizer, "chat_template", None) or CHATML_TEMPLATE
        try:
            with_tools = supports_tools(template)
        except ValueError as exc:
            raise ApiError(f"invalid chat template: {exc}", param="messages") from None
        messages = history_for_template(messages, with_tools)
        kwargs: dict[str, Any] = {}
        if tools is not None and with_tools:
            kwargs["tools"] = [dict(t) for t in tools.tools]
        elif tools is not None:
            messages = with_fallback_prompt(messages, tools)
        try:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        except ValueError as exc:
            raise ApiError(f"invalid messages: {exc}", param="messages") from None
        # the template already holds BOS and friends
        ids = self.encode(prompt, "messages", add_special_tokens=False)
        if not ids:
            raise ApiError("the prompt is empty", param="messages")
        return ids

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt as text (echo): as sent, or its token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.manager.tokenizer
        if tokenizer is None:
            return ""
        return tokenizer.decode(prompt, skip_special_tokens=False)

    def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        ids = self.encode(prompt, param)
        if not ids:
            raise ApiError("the prompt is empty after tokenization", param=param)
        return ids

    # --- OpenAI

    async def chat_completions(self, request: Request) -> Response:
        req: P.ChatCompletionRequest = await self.decode(request, P.ChatCompletionRequest)
        limits = self.limits
        P.check_model(req.model, limits)
        P.check_n(req.n)
        max_tokens, max_param = P.openai_max_tokens(req)
        top_logprobs = req.top_logprobs or 0
        if not 0 <= top_logprobs <= P.MAX_TOP_LOGPROBS:
            raise ApiError(
                f"top_logprobs must be in [0, {P.MAX_TOP_LOGPROBS}]", param="top_logprobs"
            )
        if top_logprobs and not req.logprobs:
            raise ApiError("top_logprobs requires logprobs to be true", param="top_logprobs")
        P.check_unsupported_chat_fields(req)
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)
        stop = P.normalize_stop(req.stop)
        base = P.sampling_params(req, limits, 1, response_format=req.response_format)
        schema = tools.json_schema() if tools is not None else None
        if schema is not None:
            base = self.constrain_to_tools(base, schema)
        namespace = self.namespace(request, req)
        messages = P.chat_messages(req)
        ids = self.chat_prompt_ids(messages, tools)
        max_new = P.resolve_max_new_tokens(
            len(ids), max_tokens, limits, param=max_param, prompt_param="messages"
        )
        rid = P.new_id("chatcmpl")
        inputs = [
            P.GenerateInput(
                rid=rid if req.n == 1 else f"{rid}-{i}",
                input_ids=ids,
                sampling=P.choice_sampling(base, max_new, i),
                stop=stop,
                stream=req.stream,
                return_logprob=req.logprobs,
                top_logprobs_num=top_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                cache_namespace=namespace,
            )
            for i in range(req.n)
        ]
        renderer = P.ChatRenderer(
            id=rid,
            model=limits.model_name,
            n=req.n,
            logprobs=req.logprobs,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            token_text=P.TokenText(self.manager.tokenizer),
            tools=tools,
        )
        return await self.respond(request, inputs, renderer, req.stream)

    @property
    def tool_parser(self) -> str:
        """The reply format of tool_choice "auto" (``--tool-call-parser``, or from the template)."""
        if self._tool_parser is None:
            flag = getattr(self.args, "tool_call_parser", "auto")
            self._tool_parser = resolve_parser(flag, self.manager.chat_template)
        return self._tool_parser

    @staticmethod
    def constrain_to_tools(base: Any, schema: str) -> Any:
        """tool_choice "required" / a named function: the reply is forced by a JSON schema (the
        worker compiles it; one that does not compile is a 400 before any output)."""
        if base.grammar is not None:
            raise ApiError(
                "tool_choice 'required' or a named function constrains the output already; it "
                "cannot be combined with response_format, regex, json_schema or ebnf",
                param="tool_choice",
            )
        if len(schema) > P.MAX_GRAMMAR_CHARS:
            raise ApiError(
                f"the tools' parameter schemas make a {len(schema)}-character JSON schema; the "
                f"limit is {P.MAX_GRAMMAR_CHARS}",
                param="tools",
                code="grammar_too_large",
            )
        return msgspec.structs.replace(base, json_schema=schema)

    async def completions(self, request: Request) -> Response:
        req: P.CompletionRequest = await self.decode(request, P.CompletionRequest)
        limits = self.limits
        P.check_model(req.model, limits)
        if req.suffix:
            raise ApiError("suffix is not supported", param="suffix", code="unsupported_value")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(
                "best_of other than n is not supported", param="best_of", code="unsupported_value"
            )
        max_tokens, max_param = P.openai_max_tokens(req, minimum=0 if req.echo else 1)
        if req.logprobs is not None and not 0 <= req.logprobs <= P.MAX_TOP_LOGPROBS:
            raise ApiError(f"logprobs must be in [0, {P.MAX_TOP_LOGPROBS}]", param="logprobs")
        stop = P.normalize_stop(req.stop)
        base = P.sampling_params(req, limits, 1, response_format=req.response_format)
        namespace = self.namespace(request, req)
        prompts = P.split_prompts(req.prompt, limits.vocab_size, "prompt")
        P.check_n(req.n, len(prompts))
        rid = P.new_id("cmpl")
        inputs = []
        echo_prompts: list[str] | None = [] if req.echo else None
        for p_index, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{p_index}]"
            ids = self.prompt_ids(prompt, param)
            if echo_prompts is not None:
                echo_prompts += [self.prompt_text(prompt)] * req.n
            max_new = P.resolve_max_new_tokens(
                len(ids), max_tokens, limits, param=max_param, prompt_param=param
            )
            for i in range(req.n):
                index = p_index * req.n + i
                inputs.append(
                    P.GenerateInput(
                        rid=rid if len(prompts) * req.n == 1 else f"{rid}-{index}",
                        input_ids=ids,
                        sampling=P.choice_sampling(base, max_new, i),
                        stop=stop,
                        stream=req.stream,
                        return_logprob=req.logprobs is not None,
                        top_logprobs_num=req.logprobs or 0,
                        # echo + logprobs: every prompt token's logprob (and top alternatives)
                        logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
                        skip_special_tokens=req.skip_special_tokens,
                        cache_namespace=namespace,
                    )
                )
        renderer = P.CompletionRenderer(
            id=rid,
            model=limits.model_name,
            n=req.n,
            logprobs=req.logprobs,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            token_text=P.TokenText(self.manager.tokenizer),
            echo_prompts=echo_prompts,
        )
        return await self.respond(request, inputs, renderer, req.stream)

    # --- native

    async def generate(self, request: Request) -> Response:
        logger.debug("HTTP /generate in")
        req: P.NativeGenerateRequest = await self.decode(request, P.NativeGenerateRequest)
        inputs, renderer = self.native_inputs(req, request)
        return await self.respond(request, inputs, renderer, req.stream)

    def native_inputs(
        self, req: P.NativeGenerateRequest, request: Request | None = None
    ) -> tuple[list[P.GenerateInput], P.NativeRenderer]:
        """Validate a /generate request (also used by the offline Engine, without `request`)."""
        limits = self.limits
        P.check_unsupported_native_fields(req)
        if (req.text is None) == (req.input_ids is None):
            raise ApiError("give exactly one of 'text' and 'input_ids'", param="text")
        param = "text" if req.text is not None else "input_ids"
        value = req.text if req.text is not None else req.input_ids
        if param == "input_ids" and isinstance(value, list) and value == []:
            raise ApiError("the prompt must not be empty", param=param)
        prompts = P.split_prompts(value, limits.vocab_size, param)
        if param == "text" and any(not isinstance(p, str) for p in prompts):
            raise ApiError("text must be a string or a list of strings", param=param)
        if param == "input_ids" and any(isinstance(p, str) for p in prompts):
            raise ApiError(
                "input_ids must be a list of token ids (or a list of those)", param=param
            )
        batch = not isinstance(value, str) and not (param == "input_ids" and P.is_int(value[0]))
        sp = req.sampling_params or P.NativeSamplingParams()
        if sp.max_new_tokens is not None and sp.max_new_tokens < 0:
            raise ApiError("max_new_tokens must be >= 0", param="sampling_params.max_new_tokens")
        if not 0 <= req.top_logprobs_num <= P.MAX_TOP_LOGPROBS:
            raise ApiError(
                f"top_logprobs_num must be in [0, {P.MAX_TOP_LOGPROBS}]", param="top_logprobs_num"
            )
        stop = P.normalize_stop(sp.stop, "sampling_params.stop")
        base = P.sampling_params(sp, limits, 1, prefix="sampling_params.")
        namespace = self.namespace(request, req)
        rids = self.native_rids(req.rid, len(prompts), batch)
        inputs = []
        for i, prompt in enumerate(prompts):
            p_param = f"{param}[{i}]" if batch else param
            ids = self.prompt_ids(prompt, p_param)
            max_new = P.resolve_max_new_tokens(
                len(ids),
                sp.max_new_tokens,
                limits,
                param="sampling_params.max_new_tokens",
                prompt_param=p_param,
                default=P.NATIVE_DEFAULT_MAX_NEW_TOKENS,
            )
            start = req.logprob_start_len if req.return_logprob else -1
            if not -1 <= start < len(ids):
                raise ApiError(
                    f"logprob_start_len must be in [-1, {len(ids)}) for this prompt",
                    param="logprob_start_len",
                )
            inputs.append(
                P.GenerateInput(
                    rid=rids[i],
                    input_ids=ids,
                    sampling=msgspec.structs.replace(base, max_new_tokens=max_new),
                    stop=stop,
                    stream=req.stream,
                    return_logprob=req.return_logprob,
                    top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
                    logprob_start_len=start,
                    skip_special_tokens=sp.skip_special_tokens,
                    cache_namespace=namespace,
                )
            )
        return inputs, P.NativeRenderer(inputs, batch)

    @staticmethod
    def native_rids(rid: str | list[str] | None, count: int, batch: bool) -> list[str]:
        if rid is None:
            return [P.new_id("gen") for _ in range(count)]
        if not batch:
            if not isinstance(rid, str) or not rid:
                raise ApiError("rid must be a non-empty string", param="rid")
            return [rid]
        if isinstance(rid, str) or len(rid) != count:
            raise ApiError("a batch needs a list of rids, one per prompt", param="rid")
        if len(set(rid)) != count or not all(rid):
            raise ApiError("rids must be unique and non-empty", param="rid")
        return list(rid)

    # --- readiness

    async def health_generate(self, request: Request) -> Response:
        """SGLang's readiness probe: one token through the whole pipeline (tokenizer, scheduler,
        worker). 200 once it comes back; 503 when the server is not serving or the token does
        not come within HEALTH_GENERATE_TIMEOUT_S."""
        self.check_serving()
        tokenizer = self.manager.tokenizer
        ids = list(tokenizer.encode("Hi", add_special_tokens=False)) if tokenizer else []
        inp = P.GenerateInput(
            rid=P.new_id("health"),
            input_ids=ids or [1],
            sampling=P.SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        run = _Run(self.manager, [inp])
        try:
            await asyncio.wait_for(
                _unless_disconnected(request, run.collect()), HEALTH_GENERATE_TIMEOUT_S
            )
        except _ClientGone:
            return Response(status_code=499)
        except (TimeoutError, GenerationError) as exc:
            message = str(exc) or f"no token within {HEALTH_GENERATE_TIMEOUT_S} s"
            raise ApiError(f"generation failed: {message}", status=503, code="unhealthy") from None
        finally:
            run.close()
        return json_response({"status": "ok"})

    # --- info

    def model_card(self) -> dict:
        m = self.manager
        return {
            "id": m.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "radix_runtime",
            "root": m.model_path,
            "max_model_len": m.context_length,
        }

    async def server_info(self) -> dict:
        info = dataclasses.asdict(self.args)
        info["api_key"] = None  # never echo the secret
        dynamic = await self.manager.server_info()
        if not isinstance(dynamic, dict):
            dynamic = msgspec.to_builtins(dynamic)
        info.update(dynamic)
        info.update(
            served_model_name=self.manager.model_name,
            context_length=self.manager.context_length,
            vocab_size=self.manager.vocab_size,
        )
        return info


def build_app(manager: Any, args: ServerArgs, *, lifespan: Callable | None = None) -> FastAPI:
    """The ASGI app. ``lifespan`` (FastAPI's async context manager factory) lets the caller start
    and stop background work (e.g. the manager's receive loop) on uvicorn's event loop."""
    docs = not args.disable_docs
    app = FastAPI(
        title="radix_runtime",
        docs_url="/docs" if docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if docs else None,
        lifespan=lifespan,
    )
    install_error_handlers(app)
    api = _Api(manager, args)
    app.state.api = api

    for path, route in (
        ("/v1/chat/completions", api.chat_completions),
        ("/v1/completions", api.completions),
        ("/generate", api.generate),
    ):
        extra = route_openapi(path) if docs else None
        app.add_api_route(path, route, methods=["POST"], openapi_extra=extra)
    if docs:
        install_openapi(app)

    @app.get("/health")
    async def health() -> Response:
        if not manager.healthy:
            raise ApiError("a child process died", status=503, code="unhealthy")
        if manager.draining:
            raise ApiError("the server is shutting down", status=503, code="draining")
        return json_response({"status": "ok"})

    app.add_api_route("/health_generate", api.health_generate, methods=["GET"])
    install_tokenize_routes(app, api)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [api.model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model != manager.model_name:
            raise ApiError(
                f"the model '{model}' does not exist",
                status=404,
                param="model",
                code="model_not_found",
            )
        return json_response(api.model_card())

    # NOTE: SGLang's router asks for /model_info and /server_info first, then the /get_* names
    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> Response:
        return json_response(
            {
                "model_path": manager.model_path,
                "served_model_name": manager.model_name,
                "context_length": manager.context_length,
                "chat_template": manager.chat_template,
                "vocab_size": manager.vocab_size,
            }
        )

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> Response:
        return json_response(await api.server_info())

    @app.get("/get_load")
    async def get_load() -> Response:
        """Load in SGLang's shape (one entry per data-parallel rank of this server: one), which
        the router's power_of_two policy reads: num_tokens = KV tokens held by running requests."""
        info = await manager.server_info()
        cache = info["cache"]
        return json_response(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": info["running_requests"] + info["waiting_requests"],
                    "num_waiting_reqs": info["waiting_requests"],
                    "num_tokens": cache["protected_pages"] * cache["page_size"],
                }
            ]
        )

    install_observability_routes(app, manager, args)

    tenants = load_tenants(args)
    if tenants:
        app.add_middleware(_AuthMiddleware, tenants=tenants)
    return app
