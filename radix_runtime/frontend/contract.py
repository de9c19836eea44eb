"""The contract between a front (the HTTP server, the offline ``Engine``) and the
``TokenizerManager``: what one generation asks for, what it yields, and how the increments add up.

    GenerateInput  -> TokenizerManager.generate -> GenerateChunk, GenerateChunk, ... (finish_reason)
                                                   ChoiceState.add(chunk) accumulates them

Nothing here knows HTTP, OpenAI or the scheduler's wire format.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import msgspec

from radix_runtime.messages import SamplingParams


class GenerateInput(msgspec.Struct, kw_only=True):
    """One generation, fully validated and tokenized, handed to ``TokenizerManager.generate``."""

    rid: str
    # a tuple: Python's collector stops tracking a tuple of ints, so the prompts of the requests
    # a server holds cost its full collections nothing (a list is walked element by element:
    # docs/serving_roofline.md, "What sets ITL p99")
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: list[str] = []  # stop strings: the manager trims them from the text it returns
    stream: bool = False
    return_logprob: bool = False  # logprob of every output token
    top_logprobs_num: int = 0  # also the top-k alternatives per output token
    # >= 0: also the logprob of every prompt token at positions >= this index; -1: none
    logprob_start_len: int = -1
    skip_special_tokens: bool = True
    # the radix tree namespace it shares cached KV in ("": public); see frontend/tenancy.py
    cache_namespace: str = ""


class GenerateChunk(msgspec.Struct, kw_only=True):
    """One increment of a generation, yielded by ``TokenizerManager.generate``.

    ``text``/``ids``/``output_logprobs``/``output_top_logprobs`` are deltas (new this chunk);
    ``prompt_tokens``/``completion_tokens``/``cached_tokens`` are totals so far. The last chunk has
    ``finish_reason`` set. ``prompt_logprobs`` arrives once (on the first chunk) and covers the
    *last* ``len(prompt_logprobs)`` prompt positions (position 0 has no logprob, so a request with
    ``logprob_start_len == 0`` gets ``len(input_ids) - 1`` values).
    """

    text: str = ""  # new text, UTF-8 complete, stop strings already trimmed
    ids: list[int] = []  # new output token ids
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, loaded from the host tier (docs/hicache.md)
    output_logprobs: list[float] = []  # one per id in ``ids`` (when return_logprob)
    output_top_logprobs: list[list[tuple[int, float]]] | None = None  # per id: [(id, logprob)]
    prompt_logprobs: list[float] | None = None
    # with top_logprobs_num > 0: the top alternatives of each of those prompt positions
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class ModelLimits:
    """What the validators check against."""

    model_name: str
    context_length: int
    vocab_size: int


class ChoiceState:
    """Everything one generation has produced so far."""

    __slots__ = (
        "index",
        "rid",
        "input_ids",
        "text",
        "ids",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "prompt_top_logprobs",
        "finish_reason",
        "matched_stop",
        "completion_tokens",
        "cached_tokens",
        "host_cached_tokens",
    )

    def __init__(self, index: int, rid: str, input_ids: tuple[int, ...]) -> None:
        self.index = index
        self.rid = rid
        self.input_ids = input_ids
        self.text: list[str] = []
        # an array, not a list: the collector does not walk its elements (see input_ids)
        self.ids = array("q")
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.prompt_logprobs: list[float] | None = None
        self.prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.host_cached_tokens = 0

    def add(self, chunk: GenerateChunk) -> None:
        if chunk.text:
            self.text.append(chunk.text)
        self.ids.extend(chunk.ids)
        self.logprobs.extend(chunk.output_logprobs)
        if chunk.output_top_logprobs:
            self.top_logprobs.extend(chunk.output_top_logprobs)
        if chunk.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = list(chunk.prompt_logprobs)
            self.prompt_top_logprobs = chunk.prompt_top_logprobs
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.matched_stop = chunk.matched_stop
        self.completion_tokens = max(self.completion_tokens, chunk.completion_tokens, len(self.ids))
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        self.host_cached_tokens = max(self.host_cached_tokens, chunk.host_cached_tokens)

    @property
    def full_text(self) -> str:
        return "".join(self.text)

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)
