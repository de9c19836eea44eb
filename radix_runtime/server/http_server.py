"""The HTTP front: FastAPI routes on uvicorn + uvloop.

A generation request goes: auth (middleware) -> serving gate (healthy, not draining) -> body read
with a size cap -> msgspec decode (``frontend.schemas``) -> validation, chat template and
tokenization into one ``GenerateInput`` per choice (``frontend.builders``) -> ``Generations``
drives them through ``TokenizerManager.generate`` concurrently -> a renderer
(``frontend.rendering``) shapes JSON or SSE.

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
from radix_runtime.frontend.builders import InputBuilder
from radix_runtime.frontend.contract import GenerateInput
from radix_runtime.frontend.errors import (
    AUTHENTICATION,
    SERVER_ERROR,
    ApiError,
    GenerationError,
    error_body,
)
from radix_runtime.frontend.generations import Generations
from radix_runtime.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    NativeGenerateRequest,
    decode_request,
)
from radix_runtime.frontend.tenancy import Tenant, find_tenant, load_tenants
from radix_runtime.server.errors import error_response, install_error_handlers
from radix_runtime.server.observability import install_observability_routes
from radix_runtime.server.openapi import install_openapi, route_openapi
from radix_runtime.server.tokenize_routes import install_tokenize_routes

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
# client disconnects


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


class HttpApi:
    """The generation routes over HTTP: the body read, decode and answer are HTTP's; what a
    request means is the ``InputBuilder``'s (shared with the offline Engine)."""

    def __init__(self, manager: Any, args: ServerArgs) -> None:
        self.manager = manager
        self.args = args
        self.builder = InputBuilder(manager, args)
        self.created = int(time.time())

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
        self.builder.check_serving()  # before reading the body: a 503 costs no upload
        return decode_request(await self.read_body(request), type_)

    async def respond(
        self, request: Request, inputs: list[GenerateInput], renderer: Any, stream: bool
    ) -> Response:
        run = Generations(self.manager, inputs)
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

    async def _events(self, run: Generations, first: Any, renderer: Any):
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

    @staticmethod
    def tenant(request: Request) -> Tenant | None:
        """The caller's tenant, which the auth middleware found from its API key."""
        return request.scope.get(TENANT_SCOPE_KEY)

    # --- generation routes

    async def chat_completions(self, request: Request) -> Response:
        req = await self.decode(request, ChatCompletionRequest)
        inputs, renderer = self.builder.chat(req, self.tenant(request))
        return await self.respond(request, inputs, renderer, req.stream)

    async def completions(self, request: Request) -> Response:
        req = await self.decode(request, CompletionRequest)
        inputs, renderer = self.builder.completion(req, self.tenant(request))
        stream = req.stream
        del req  # its prompt ids (a list) live on as the inputs' tuples only
        return await self.respond(request, inputs, renderer, stream)

    async def generate(self, request: Request) -> Response:
        logger.debug("HTTP /generate in")
        req = await self.decode(request, NativeGenerateRequest)
        inputs, renderer = self.builder.native(req, self.tenant(request))
        stream = req.stream
        del req  # its prompt ids (a list) live on as the inputs' tuples only
        return await self.respond(request, inputs, renderer, stream)

    # --- readiness

    async def health_generate(self, request: Request) -> Response:
        """SGLang's readiness probe: one token through the whole pipeline (tokenizer, scheduler,
        worker). 200 once it comes back; 503 when the server is not serving or the token does
        not come within HEALTH_GENERATE_TIMEOUT_S."""
        self.builder.check_serving()
        run = Generations(self.manager, [self.builder.health_check_input()])
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
    api = HttpApi(manager, args)
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
        api.builder.check_serving()
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
