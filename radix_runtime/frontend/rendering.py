"""Renderers: a generation's accumulated state -> the JSON one route answers with.

``response(states)`` is the non-streaming body; ``stream_chunk(state, chunk)`` the payloads
(SSE events over HTTP) for one increment; ``stream_end(states)`` those sent after the last
increment (before [DONE]). The two OpenAI routes share ``OpenAIRenderer`` (ids, the chunk
envelope, usage); ``NativeRenderer`` answers /generate.
"""

from __future__ import annotations

import time
from typing import Any

from radix_runtime.frontend.contract import ChoiceState, GenerateChunk, GenerateInput
from radix_runtime.frontend.tools import ToolPlan, parse_reply


def usage(choices: list[ChoiceState], n: int) -> dict:
    """Prompt and cached tokens count once per prompt (the first of its n choices)."""
    prompt = sum(c.prompt_tokens for c in choices if c.index % n == 0)
    cached = sum(c.cached_tokens for c in choices if c.index % n == 0)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------------------------
# logprobs in the OpenAI shapes


class TokenText:
    """Token id -> its text, memoized per request (top-k lists repeat tokens a lot)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, tok: int) -> str:
        text = self._cache.get(tok)
        if text is None:
            if self._tokenizer is None:  # dummy weights: no vocabulary to show
                text = f"token_id:{tok}"
            else:
                text = self._tokenizer.decode([tok])
            self._cache[tok] = text
        return text


def chat_logprobs(
    ids: list[int],
    logprobs: list[float],
    tops: list[list[tuple[int, float]]],
    token_text: TokenText,
) -> dict:
    content = []
    for i, (tok, lp) in enumerate(zip(ids, logprobs)):
        text = token_text(tok)
        top = tops[i] if i < len(tops) else []
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := token_text(tid)), "logprob": tlp, "bytes": list(t.encode())}
                    for tid, tlp in top
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    ids: list[int],
    logprobs: list[float],
    tops: list[list[tuple[int, float]]],
    token_text: TokenText,
    text_offset: int = 0,
    with_top: bool = True,
) -> dict:
    tokens, offsets, top_out = [], [], []
    for i, tok in enumerate(ids[: len(logprobs)]):
        text = token_text(tok)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if with_top:
            top = tops[i] if i < len(tops) else []
            top_out.append({token_text(tid): tlp for tid, tlp in top})
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs[: len(tokens)]),
        "top_logprobs": top_out if with_top else None,
        "text_offset": offsets,
    }


# ---------------------------------------------------------------------------------------------
# native /generate output


def _finish_info(state: ChoiceState) -> dict | None:
    reason = state.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": state.completion_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": state.matched_stop}
    return {"type": reason, "matched": state.matched_stop}


def native_output(state: ChoiceState, inp: GenerateInput) -> dict:
    meta: dict[str, Any] = {
        "id": state.rid,
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": state.completion_tokens,
        "cached_tokens": state.cached_tokens,
        # the prefix's tiers: device_cached_tokens + host_cached_tokens == cached_tokens
        "device_cached_tokens": state.cached_tokens - state.host_cached_tokens,
        "host_cached_tokens": state.host_cached_tokens,
        "finish_reason": _finish_info(state),
    }
    if inp.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok] for lp, tok in zip(state.logprobs, state.ids)]
        if inp.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [
                [[lp, tok] for tok, lp in top] for top in state.top_logprobs
            ]
        if inp.logprob_start_len >= 0:
            meta["input_token_logprobs"] = _input_logprobs(state, inp.logprob_start_len)
            if inp.top_logprobs_num > 0:
                meta["input_top_logprobs"] = _input_top_logprobs(state, inp.logprob_start_len)
    return {"text": state.full_text, "output_ids": list(state.ids), "meta_info": meta}


def _input_logprobs(state: ChoiceState, start: int) -> list[list]:
    """[[logprob | None, id]] for prompt positions >= start; the manager's values cover the last
    len(values) positions (position 0 has none)."""
    ids = state.input_ids
    values = state.prompt_logprobs or []
    first_known = len(ids) - len(values)
    out = []
    for pos in range(start, len(ids)):
        k = pos - first_known
        out.append([values[k] if k >= 0 else None, ids[pos]])
    return out


def _input_top_logprobs(state: ChoiceState, start: int) -> list[list | None]:
    """[[logprob, id] of the top alternatives] (None where unknown) per prompt position >= start,
    aligned like _input_logprobs."""
    ids = state.input_ids
    tops = state.prompt_top_logprobs or []
    first_known = len(ids) - len(tops)
    return [
        [[lp, tok] for tok, lp in tops[pos - first_known]] if pos >= first_known else None
        for pos in range(start, len(ids))
    ]


# ---------------------------------------------------------------------------------------------
# the OpenAI renderers


class OpenAIRenderer:
    """What /v1/chat/completions and /v1/completions share: the response and chunk envelopes
    (``object`` names them), usage, and a stream that ends with a usage chunk when asked.
    A subclass says what one choice looks like (``choice``) and what one increment adds
    (``stream_chunk``)."""

    object = ""  # the non-streaming response's "object"
    chunk_object = ""  # each streamed chunk's

    def __init__(
        self, *, id: str, model: str, n: int, include_usage: bool, token_text: TokenText
    ) -> None:
        self.id = id
        self.model = model
        self.created = now()
        self.n = n
        self.include_usage = include_usage
        self.token_text = token_text

    def choice(self, state: ChoiceState) -> dict:
        raise NotImplementedError

    def response(self, states: list[ChoiceState]) -> dict:
        body = self._envelope(self.object, [self.choice(s) for s in states])
        body["usage"] = usage(states, self.n)
        return body

    def _envelope(self, object: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def _chunk(self, choices: list[dict]) -> dict:
        out = self._envelope(self.chunk_object, choices)
        if self.include_usage:
            out["usage"] = None
        return out

    def stream_chunk(self, state: ChoiceState, chunk: GenerateChunk) -> list[dict]:
        raise NotImplementedError

    def stream_end(self, states: list[ChoiceState]) -> list[dict]:
        if not self.include_usage:
            return []
        last = self._chunk([])
        last["usage"] = usage(states, self.n)
        return [last]


class ChatRenderer(OpenAIRenderer):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *, logprobs: bool, tools: ToolPlan | None = None, **common: Any) -> None:
        super().__init__(**common)
        self.logprobs = logprobs
        self.tools = tools
        self._started: set[int] = set()
        self._parsers: dict = {}  # choice index -> its ToolCallParser, when streaming tools

    def _logprobs(self, ids, logprobs, tops) -> dict | None:
        if not self.logprobs:
            return None
        return chat_logprobs(ids, logprobs, tops or [], self.token_text)

    def _message(self, state: ChoiceState) -> tuple[dict, str | None]:
        """The assistant message and finish reason of one choice (tool calls parsed out)."""
        if self.tools is None:
            return {"role": "assistant", "content": state.full_text}, state.finish_reason
        content, calls = parse_reply(self.tools, state.full_text)
        if not calls:
            return {"role": "assistant", "content": content}, state.finish_reason
        message = {
            "role": "assistant",
            "content": content or None,
            "tool_calls": [c.message() for c in calls],
        }
        return message, _tool_finish(state.finish_reason)

    def choice(self, state: ChoiceState) -> dict:
        message, finish_reason = self._message(state)
        return {
            "index": state.index,
            "message": message,
            "logprobs": self._logprobs(state.ids, state.logprobs, state.top_logprobs),
            "finish_reason": finish_reason,
            "matched_stop": state.matched_stop,
        }

    def _delta(self, index: int, delta: dict, finish_reason: str | None = None) -> dict:
        return self._chunk(
            [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        )

    def stream_chunk(self, state: ChoiceState, chunk: GenerateChunk) -> list[dict]:
        out = []
        if state.index not in self._started:
            self._started.add(state.index)
            out.append(self._delta(state.index, {"role": "assistant", "content": ""}))
        has_logprobs = self.logprobs and chunk.ids
        text, finish_reason, calls = chunk.text, chunk.finish_reason, []
        if self.tools is not None:
            text, calls, finish_reason = self._tool_step(state, chunk)
        # the finish reason rides on the last content chunk, or follows the tool call deltas
        final_here = finish_reason is not None and not calls
        if text or has_logprobs or final_here:
            choice = {
                "index": state.index,
                "delta": {"content": text} if text or has_logprobs else {},
                "logprobs": self._logprobs(
                    chunk.ids, chunk.output_logprobs, chunk.output_top_logprobs
                ),
                "finish_reason": finish_reason if final_here else None,
            }
            if final_here:
                choice["matched_stop"] = chunk.matched_stop
            out.append(self._chunk([choice]))
        for delta in calls:
            out.append(self._delta(state.index, {"tool_calls": [delta]}))
        if finish_reason is not None and calls:
            last = self._delta(state.index, {}, finish_reason)
            last["choices"][0]["matched_stop"] = chunk.matched_stop
            out.append(last)
        return out

    def _tool_step(self, state: ChoiceState, chunk: GenerateChunk) -> tuple[str, list, str | None]:
        parser = self._parsers.get(state.index)
        if parser is None:
            parser = self._parsers[state.index] = self.tools.new_parser()
        step = parser.feed(chunk.text)
        text, deltas = step.content, list(step.deltas)
        finish_reason = chunk.finish_reason
        if finish_reason is not None:
            last = parser.finish()
            text += last.content
            deltas += last.deltas
            if parser.calls:
                finish_reason = _tool_finish(finish_reason)
        return text, deltas, finish_reason


def _tool_finish(reason: str | None) -> str | None:
    """A reply that ended by itself with tool calls finishes with ``tool_calls``."""
    return "tool_calls" if reason == "stop" else reason


class CompletionRenderer(OpenAIRenderer):
    """/v1/completions. With ``echo`` (one prompt text per choice in ``echo_prompts``) each
    choice's text starts with its prompt, and with ``logprobs`` its logprobs start with the
    prompt's tokens, the first with a ``null`` logprob (nothing comes before it), as OpenAI and
    vLLM return them: what lm-evaluation-harness's log-likelihood tasks read."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(
        self, *, logprobs: int | None, echo_prompts: list[str] | None = None, **common: Any
    ) -> None:
        super().__init__(**common)
        self.logprobs = logprobs
        self.echo_prompts = echo_prompts
        self._echoed: set[int] = set()

    def _logprobs(self, ids, logprobs, tops, offset: int) -> dict | None:
        if self.logprobs is None:
            return None
        return completion_logprobs(
            ids, logprobs, tops or [], self.token_text, offset, with_top=self.logprobs > 0
        )

    def _echo(self, state: ChoiceState) -> tuple[str, dict | None]:
        """The prompt's text and (with logprobs) its tokens' logprobs, once per choice."""
        self._echoed.add(state.index)
        text = self.echo_prompts[state.index]
        if self.logprobs is None:
            return text, None
        ids = state.input_ids
        values = state.prompt_logprobs or []
        tops = state.prompt_top_logprobs or []
        # positions 1.. have a logprob (the values cover the last len(values) positions)
        lps: list[float | None] = [None] * (len(ids) - len(values)) + list(values)
        tops_all = [None] * (len(ids) - len(tops)) + list(tops)
        out = completion_logprobs(
            ids, lps, [t or [] for t in tops_all], self.token_text, 0, self.logprobs > 0
        )
        if out["top_logprobs"] is not None:
            out["top_logprobs"] = [
                None if t is None else top for t, top in zip(tops_all, out["top_logprobs"])
            ]
        return text, out

    def _choice_text_and_logprobs(
        self, state: ChoiceState, text: str, ids, lps, tops, gen_offset: int
    ) -> tuple[str, dict | None]:
        """A choice's text and logprobs for generated `text` starting at `gen_offset` of the
        generated text; the echoed prompt goes in front of the choice's first."""
        prefix, prompt_lps = "", None
        if self.echo_prompts is not None and state.index not in self._echoed:
            prefix, prompt_lps = self._echo(state)
        echoed = len(self.echo_prompts[state.index]) if self.echo_prompts is not None else 0
        gen = self._logprobs(ids, lps, tops, echoed + gen_offset)
        if prompt_lps is not None and gen is not None:
            for key in ("tokens", "token_logprobs", "text_offset"):
                gen[key] = prompt_lps[key] + gen[key]
            if gen["top_logprobs"] is not None:
                gen["top_logprobs"] = prompt_lps["top_logprobs"] + gen["top_logprobs"]
        return prefix + text, gen

    def choice(self, state: ChoiceState) -> dict:
        text, logprobs = self._choice_text_and_logprobs(
            state, state.full_text, state.ids, state.logprobs, state.top_logprobs, 0
        )
        return {
            "index": state.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": state.finish_reason,
            "matched_stop": state.matched_stop,
        }

    def stream_chunk(self, state: ChoiceState, chunk: GenerateChunk) -> list[dict]:
        has_logprobs = self.logprobs is not None and chunk.ids
        echo = self.echo_prompts is not None and state.index not in self._echoed
        if not (chunk.text or chunk.finish_reason is not None or has_logprobs or echo):
            return []
        offset = len(state.full_text) - len(chunk.text)
        text, logprobs = self._choice_text_and_logprobs(
            state, chunk.text, chunk.ids, chunk.output_logprobs, chunk.output_top_logprobs, offset
        )
        choice = {
            "index": state.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": chunk.finish_reason,
        }
        if chunk.finish_reason is not None:
            choice["matched_stop"] = chunk.matched_stop
        return [self._chunk([choice])]


class NativeRenderer:
    """/generate: one ``{"text", "output_ids", "meta_info"}`` per input (a list for a batch);
    streamed events are cumulative, with ``index`` for a batch."""

    def __init__(self, inputs: list[GenerateInput], batch: bool) -> None:
        self.inputs = inputs
        self.batch = batch

    def response(self, states: list[ChoiceState]) -> dict | list[dict]:
        outs = [native_output(s, self.inputs[s.index]) for s in states]
        return outs if self.batch else outs[0]

    def stream_chunk(self, state: ChoiceState, chunk: GenerateChunk) -> list[dict]:
        out = native_output(state, self.inputs[state.index])
        if self.batch:
            out["index"] = state.index
        return [out]

    def stream_end(self, states: list[ChoiceState]) -> list[dict]:
        return []
