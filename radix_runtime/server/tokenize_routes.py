"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, GET /tokenizer_info.

Clients that count or align tokens against the server's own tokenizer use them; among them
lm-evaluation-harness, whose `local-completions` model finds them by itself and then needs no
local copy of the tokenizer (its log-likelihood tasks must know where the context's tokens end).
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from radix_runtime.frontend.errors import ApiError
from radix_runtime.frontend.schemas import ApiRequest
from radix_runtime.frontend.validation import check_model

_json = msgspec.json.Encoder()


class TokenizeRequest(ApiRequest, kw_only=True):
    prompt: str
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(ApiRequest, kw_only=True):
    tokens: list[int]
    model: str | None = None


def install_tokenize_routes(app: FastAPI, api: Any) -> None:
    """`api` is http_server's HttpApi (body reading; its builder holds limits and tokenizer)."""
    builder = api.builder

    def respond(obj: Any) -> Response:
        return Response(_json.encode(obj), media_type="application/json")

    async def tokenize(request: Request) -> Response:
        req: TokenizeRequest = await api.decode(request, TokenizeRequest)
        check_model(req.model, builder.limits)
        ids = builder.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        return respond(
            {"count": len(ids), "max_model_len": builder.limits.context_length, "tokens": ids}
        )

    async def detokenize(request: Request) -> Response:
        req: DetokenizeRequest = await api.decode(request, DetokenizeRequest)
        limits = builder.limits
        check_model(req.model, limits)
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise ApiError(
                f"token id {req.tokens[bad]} is outside the vocabulary [0, {limits.vocab_size})",
                param=f"tokens[{bad}]",
            )
        text = builder.tokenizer("tokens").decode(req.tokens, skip_special_tokens=False)
        return respond({"prompt": text})

    async def tokenizer_info(request: Request) -> Response:
        tokenizer = builder.tokenizer("model")
        return respond(
            {
                "tokenizer_class": type(tokenizer).__name__,
                "bos_token": getattr(tokenizer, "bos_token", None),
                "eos_token": getattr(tokenizer, "eos_token", None),
                "pad_token": None,
                "chat_template": getattr(tokenizer, "chat_template", None),
                "model_max_length": builder.limits.context_length,
            }
        )

    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"])
