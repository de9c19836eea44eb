"""Route -> input builders: a decoded, validated request becomes one ``GenerateInput`` per
generation (n choices x prompts) and the renderer that shapes the answer.

    ChatCompletionRequest  -> chat()        -> [GenerateInput] + ChatRenderer
    CompletionRequest      -> completion()  -> [GenerateInput] + CompletionRenderer
    NativeGenerateRequest  -> native()      -> [GenerateInput] + NativeRenderer

The HTTP routes (server/http_server.py) and the offline ``Engine`` both build their inputs
here; the caller names the request's tenant (from its API key), if any.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from radix_runtime.frontend import validation as V
from radix_runtime.frontend.contract import GenerateInput, ModelLimits
from radix_runtime.frontend.errors import ApiError
from radix_runtime.frontend.rendering import (
    ChatRenderer,
    CompletionRenderer,
    NativeRenderer,
    TokenText,
)
from radix_runtime.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    NativeGenerateRequest,
    NativeSamplingParams,
    OpenAIRequest,
)
from radix_runtime.frontend.tenancy import Tenant, cache_namespace
from radix_runtime.frontend.tools import (
    ToolPlan,
    history_for_template,
    plan_tools,
    resolve_parser,
    with_fallback_prompt,
)
from radix_runtime.messages import SamplingParams
from radix_runtime.tokenizer.chat_template import CHATML_TEMPLATE, supports_tools


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class InputBuilder:
    """Builds the inputs of requests for one ``TokenizerManager`` (its tokenizer, chat template
    and model limits) under one ``ServerArgs`` (cache isolation, tool-call parser)."""

    def __init__(self, manager: Any, args: Any) -> None:
        self.manager = manager
        self.args = args
        self._tool_parser: str | None = None

    @property
    def limits(self) -> ModelLimits:
        m = self.manager
        return ModelLimits(m.model_name, m.context_length, m.vocab_size)

    def check_serving(self) -> None:
        """Refuse new work while the manager does not serve (a 503 naming why)."""
        error = self.manager.serving_error()
        if error is not None:
            raise error.to_api_error()

    def namespace(
        self, req: OpenAIRequest | NativeGenerateRequest, tenant: Tenant | None = None
    ) -> str:
        """The radix tree namespace of this request (frontend/tenancy.py)."""
        salt = V.cache_salt(req)
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

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        tokenizer = self.tokenizer(param)
        return tuple(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt_ids(
        self, messages: list[dict], tools: ToolPlan | None = None
    ) -> tuple[int, ...]:
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

    def prompt_ids(self, prompt: str | list[int], param: str) -> tuple[int, ...]:
        if isinstance(prompt, list):
            return tuple(prompt)  # GenerateInput.input_ids: a tuple, see there
        ids = self.encode(prompt, param)
        if not ids:
            raise ApiError("the prompt is empty after tokenization", param=param)
        return ids

    # --- OpenAI

    def chat(
        self, req: ChatCompletionRequest, tenant: Tenant | None = None
    ) -> tuple[list[GenerateInput], ChatRenderer]:
        limits = self.limits
        V.check_model(req.model, limits)
        V.check_n(req.n)
        max_tokens, max_param = V.openai_max_tokens(req)
        top_logprobs = req.top_logprobs or 0
        if not 0 <= top_logprobs <= V.MAX_TOP_LOGPROBS:
            raise ApiError(
                f"top_logprobs must be in [0, {V.MAX_TOP_LOGPROBS}]", param="top_logprobs"
            )
        if top_logprobs and not req.logprobs:
            raise ApiError("top_logprobs requires logprobs to be true", param="top_logprobs")
        V.check_unsupported_chat_fields(req)
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)
        stop = V.normalize_stop(req.stop)
        base = V.sampling_params(req, limits, 1, response_format=req.response_format)
        schema = tools.json_schema() if tools is not None else None
        if schema is not None:
            base = self.constrain_to_tools(base, schema)
        namespace = self.namespace(req, tenant)
        messages = V.chat_messages(req)
        ids = self.chat_prompt_ids(messages, tools)
        max_new = V.resolve_max_new_tokens(
            len(ids), max_tokens, limits, param=max_param, prompt_param="messages"
        )
        rid = new_id("chatcmpl")
        inputs = [
            GenerateInput(
                rid=rid if req.n == 1 else f"{rid}-{i}",
                input_ids=ids,
                sampling=V.choice_sampling(base, max_new, i),
                stop=stop,
                stream=req.stream,
                return_logprob=req.logprobs,
                top_logprobs_num=top_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                cache_namespace=namespace,
            )
            for i in range(req.n)
        ]
        renderer = ChatRenderer(
            logprobs=req.logprobs, tools=tools, **self._renderer_common(req, rid, limits)
        )
        return inputs, renderer

    def _renderer_common(self, req: OpenAIRequest, rid: str, limits: ModelLimits) -> dict:
        return {
            "id": rid,
            "model": limits.model_name,
            "n": req.n,
            "include_usage": bool(req.stream_options and req.stream_options.include_usage),
            "token_text": TokenText(self.manager.tokenizer),
        }

    @property
    def tool_parser(self) -> str:
        """The reply format of tool_choice "auto" (``--tool-call-parser``, or from the template)."""
        if self._tool_parser is None:
            flag = getattr(self.args, "tool_call_parser", "auto")
            self._tool_parser = resolve_parser(flag, self.manager.chat_template)
        return self._tool_parser

    @staticmethod
    def constrain_to_tools(base: SamplingParams, schema: str) -> SamplingParams:
        """tool_choice "required" / a named function: the reply is forced by a JSON schema (the
        worker compiles it; one that does not compile is a 400 before any output)."""
        if base.grammar is not None:
            raise ApiError(
                "tool_choice 'required' or a named function constrains the output already; it "
                "cannot be combined with response_format, regex, json_schema or ebnf",
                param="tool_choice",
            )
        if len(schema) > V.MAX_GRAMMAR_CHARS:
            raise ApiError(
                f"the tools' parameter schemas make a {len(schema)}-character JSON schema; the "
                f"limit is {V.MAX_GRAMMAR_CHARS}",
                param="tools",
                code="grammar_too_large",
            )
        return msgspec.structs.replace(base, json_schema=schema)

    def completion(
        self, req: CompletionRequest, tenant: Tenant | None = None
    ) -> tuple[list[GenerateInput], CompletionRenderer]:
        limits = self.limits
        V.check_model(req.model, limits)
        if req.suffix:
            raise ApiError("suffix is not supported", param="suffix", code="unsupported_value")
        if req.best_of is not None and req.best_of != req.n:
            raise ApiError(
                "best_of other than n is not supported", param="best_of", code="unsupported_value"
            )
        max_tokens, max_param = V.openai_max_tokens(req, minimum=0 if req.echo else 1)
        if req.logprobs is not None and not 0 <= req.logprobs <= V.MAX_TOP_LOGPROBS:
            raise ApiError(f"logprobs must be in [0, {V.MAX_TOP_LOGPROBS}]", param="logprobs")
        stop = V.normalize_stop(req.stop)
        base = V.sampling_params(req, limits, 1, response_format=req.response_format)
        namespace = self.namespace(req, tenant)
        prompts = V.split_prompts(req.prompt, limits.vocab_size, "prompt")
        V.check_n(req.n, len(prompts))
        rid = new_id("cmpl")
        inputs = []
        echo_prompts: list[str] | None = [] if req.echo else None
        for p_index, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{p_index}]"
            ids = self.prompt_ids(prompt, param)
            if echo_prompts is not None:
                echo_prompts += [self.prompt_text(prompt)] * req.n
            max_new = V.resolve_max_new_tokens(
                len(ids), max_tokens, limits, param=max_param, prompt_param=param
            )
            for i in range(req.n):
                index = p_index * req.n + i
                inputs.append(
                    GenerateInput(
                        rid=rid if len(prompts) * req.n == 1 else f"{rid}-{index}",
                        input_ids=ids,
                        sampling=V.choice_sampling(base, max_new, i),
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
        renderer = CompletionRenderer(
            logprobs=req.logprobs,
            echo_prompts=echo_prompts,
            **self._renderer_common(req, rid, limits),
        )
        return inputs, renderer

    # --- native

    def native(
        self, req: NativeGenerateRequest, tenant: Tenant | None = None
    ) -> tuple[list[GenerateInput], NativeRenderer]:
        limits = self.limits
        V.check_unsupported_native_fields(req)
        if (req.text is None) == (req.input_ids is None):
            raise ApiError("give exactly one of 'text' and 'input_ids'", param="text")
        param = "text" if req.text is not None else "input_ids"
        value = req.text if req.text is not None else req.input_ids
        if param == "input_ids" and isinstance(value, list) and value == []:
            raise ApiError("the prompt must not be empty", param=param)
        prompts = V.split_prompts(value, limits.vocab_size, param)
        if param == "text" and any(not isinstance(p, str) for p in prompts):
            raise ApiError("text must be a string or a list of strings", param=param)
        if param == "input_ids" and any(isinstance(p, str) for p in prompts):
            raise ApiError(
                "input_ids must be a list of token ids (or a list of those)", param=param
            )
        batch = not isinstance(value, str) and not (param == "input_ids" and V.is_int(value[0]))
        sp = req.sampling_params or NativeSamplingParams()
        if sp.max_new_tokens is not None and sp.max_new_tokens < 0:
            raise ApiError("max_new_tokens must be >= 0", param="sampling_params.max_new_tokens")
        if not 0 <= req.top_logprobs_num <= V.MAX_TOP_LOGPROBS:
            raise ApiError(
                f"top_logprobs_num must be in [0, {V.MAX_TOP_LOGPROBS}]", param="top_logprobs_num"
            )
        stop = V.normalize_stop(sp.stop, "sampling_params.stop")
        base = V.sampling_params(sp, limits, 1, prefix="sampling_params.")
        namespace = self.namespace(req, tenant)
        rids = self.native_rids(req.rid, len(prompts), batch)
        inputs = []
        for i, prompt in enumerate(prompts):
            p_param = f"{param}[{i}]" if batch else param
            ids = self.prompt_ids(prompt, p_param)
            max_new = V.resolve_max_new_tokens(
                len(ids),
                sp.max_new_tokens,
                limits,
                param="sampling_params.max_new_tokens",
                prompt_param=p_param,
                default=V.NATIVE_DEFAULT_MAX_NEW_TOKENS,
            )
            start = req.logprob_start_len if req.return_logprob else -1
            if not -1 <= start < len(ids):
                raise ApiError(
                    f"logprob_start_len must be in [-1, {len(ids)}) for this prompt",
                    param="logprob_start_len",
                )
            inputs.append(
                GenerateInput(
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
        return inputs, NativeRenderer(inputs, batch)

    @staticmethod
    def native_rids(rid: str | list[str] | None, count: int, batch: bool) -> list[str]:
        if rid is None:
            return [new_id("gen") for _ in range(count)]
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

    def health_check_input(self) -> GenerateInput:
        """One greedy token through the whole pipeline (SGLang's /health_generate)."""
        tokenizer = self.manager.tokenizer
        ids = tuple(tokenizer.encode("Hi", add_special_tokens=False)) if tokenizer else ()
        return GenerateInput(
            rid=new_id("health"),
            input_ids=ids or (1,),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
