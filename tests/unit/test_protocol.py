"""frontend/ without HTTP: decoding (schemas), validation, accumulation (contract) and response
shapes (rendering)."""

from __future__ import annotations

import gc

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radix_runtime.frontend.contract import ChoiceState, GenerateChunk, GenerateInput, ModelLimits
from radix_runtime.frontend.errors import ApiError, from_msgspec_error
from radix_runtime.frontend.rendering import TokenText, completion_logprobs, native_output, usage
from radix_runtime.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    NativeGenerateRequest,
    SamplingFields,
    decode_request,
)
from radix_runtime.frontend.validation import (
    MAX_SEED,
    MAX_STOP,
    chat_messages,
    choice_sampling,
    normalize_stop,
    resolve_max_new_tokens,
    sampling_params,
    split_prompts,
)
from radix_runtime.messages import SamplingParams

LIMITS = ModelLimits("m", context_length=100, vocab_size=50)


def test_msgspec_error_paths_become_params():
    def err(body: bytes) -> ApiError:
        with pytest.raises(ApiError) as info:
            decode_request(body, ChatCompletionRequest)
        return info.value

    e = err(b'{"messages": [{"role": "user", "content": 3}]}')
    assert (e.status, e.param, e.code) == (400, "messages[0].content", "invalid_type")
    assert "- at" not in e.message
    e = err(b'{"messages": [{"content": "x"}]}')
    assert (e.param, e.code) == ("messages[0].role", "missing_required_parameter")
    e = err(b"{}")
    assert (e.param, e.code) == ("messages", "missing_required_parameter")
    e = err(b"[]")
    assert (e.param, e.code) == (None, "invalid_type")
    e = err(b"{")
    assert (e.param, e.code) == (None, "invalid_json")


def test_from_msgspec_error_dict_value_names_the_dict():
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(
            b'{"messages": [], "logit_bias": {"5": "x"}}', type=ChatCompletionRequest
        )
    assert from_msgspec_error(info.value).param == "logit_bias"  # msgspec hides dict keys


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decode_never_escapes_apierror_on_bytes(body):
    for type_ in (ChatCompletionRequest, CompletionRequest, NativeGenerateRequest):
        try:
            decode_request(body, type_)
        except ApiError as exc:
            assert exc.status == 400


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_decode_never_escapes_apierror_on_json(value):
    body = msgspec.json.encode(value)
    for type_ in (ChatCompletionRequest, CompletionRequest, NativeGenerateRequest):
        try:
            decode_request(body, type_)
        except ApiError as exc:
            assert exc.status == 400


def test_sampling_defaults():
    sp = sampling_params(SamplingFields(), LIMITS, 7)
    assert sp == SamplingParams(max_new_tokens=7)


def test_sampling_prefix_in_param():
    with pytest.raises(ApiError) as info:
        sampling_params(SamplingFields(top_k=0), LIMITS, 1, prefix="sampling_params.")
    assert info.value.param == "sampling_params.top_k"


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": float("nan")},
        {"min_p": -0.1},
        {"logit_bias": {"1": float("nan")}},
        {"seed": 2**63},
    ],
)
def test_sampling_rejects_non_finite_and_out_of_range(fields):
    with pytest.raises(ApiError):
        sampling_params(SamplingFields(**fields), LIMITS, 1)


def test_choice_sampling_offsets_seed():
    base = sampling_params(SamplingFields(seed=MAX_SEED), LIMITS, 1)
    assert choice_sampling(base, 5, 0).seed == MAX_SEED
    assert choice_sampling(base, 5, 1).seed == 0  # wraps, stays in range
    assert choice_sampling(base, 5, 1).max_new_tokens == 5
    unseeded = sampling_params(SamplingFields(), LIMITS, 1)
    assert choice_sampling(unseeded, 5, 3).seed is None


def test_normalize_stop():
    assert normalize_stop(None) == []
    assert normalize_stop("x") == ["x"]
    assert normalize_stop(["a", "", "a", "b"]) == ["a", "b"]
    with pytest.raises(ApiError):
        normalize_stop(["s"] * (MAX_STOP + 1))


def test_resolve_max_new_tokens():
    kw = {"param": "max_tokens", "prompt_param": "prompt"}
    assert resolve_max_new_tokens(10, None, LIMITS, **kw) == 90
    assert resolve_max_new_tokens(10, None, LIMITS, default=20, **kw) == 20
    assert resolve_max_new_tokens(95, None, LIMITS, default=20, **kw) == 5
    assert resolve_max_new_tokens(10, 90, LIMITS, **kw) == 90
    assert resolve_max_new_tokens(10, 0, LIMITS, **kw) == 0  # /generate prefill only
    for prompt, requested, param, code in [
        (10, 91, "prompt", "context_length_exceeded"),
        (100, None, "prompt", "context_length_exceeded"),
        (10, 101, "max_tokens", "invalid_value"),
    ]:
        with pytest.raises(ApiError) as info:
            resolve_max_new_tokens(prompt, requested, LIMITS, **kw)
        assert (info.value.param, info.value.code) == (param, code)


def test_split_prompts():
    assert split_prompts("ab", 50, "prompt") == ["ab"]
    assert split_prompts([1, 2], 50, "prompt") == [[1, 2]]
    assert split_prompts(["a", [3]], 50, "prompt") == ["a", [3]]
    for bad, param in [
        ([], "prompt"),
        ([1, 50], "prompt[1]"),
        ([[1], [True]], "prompt[1]"),
        ([None], "prompt[0]"),
        ([1.0], "prompt[0]"),
    ]:
        with pytest.raises(ApiError) as info:
            split_prompts(bad, 50, "prompt")
        assert info.value.param == param


def test_chat_messages():
    req = msgspec.json.decode(
        b'{"messages": [{"role": "developer", "content": "s"},'
        b'{"role": "user", "name": "bob", "content": [{"type": "text", "text": "a"},'
        b'{"type": "text", "text": "b"}]}]}',
        type=ChatCompletionRequest,
    )
    assert chat_messages(req) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a\nb", "name": "bob"},
    ]


def _state(chunks, input_ids=(5, 6, 7, 8), index=0):
    state = ChoiceState(index, f"r{index}", list(input_ids))
    for c in chunks:
        state.add(c)
    return state


def test_choice_state_accumulates():
    s = _state(
        [
            GenerateChunk(text="a", ids=[1], completion_tokens=1, cached_tokens=2),
            GenerateChunk(text="", ids=[2], completion_tokens=2, cached_tokens=2),
            GenerateChunk(text="bc", ids=[3], completion_tokens=3, finish_reason="stop"),
        ]
    )
    assert s.full_text == "abc" and list(s.ids) == [1, 2, 3]
    # an array: a full collection follows no reference per element (a list: one per id)
    assert len(gc.get_referents(s.ids)) <= 1
    assert (s.completion_tokens, s.cached_tokens, s.finish_reason) == (3, 2, "stop")


def test_usage_counts_prompt_once_per_prompt():
    chunks = [GenerateChunk(ids=[1, 2], completion_tokens=2, cached_tokens=1)]
    states = [_state(chunks, index=i) for i in range(4)]  # 2 prompts x n=2
    u = usage(states, n=2)
    assert u == {
        "prompt_tokens": 8,
        "completion_tokens": 8,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_native_output_input_logprobs_alignment():
    inp = GenerateInput(
        rid="r",
        input_ids=[5, 6, 7, 8],
        sampling=SamplingParams(),
        return_logprob=True,
        logprob_start_len=1,
    )
    # the manager covers positions 1..3 (position 0 has no logprob)
    s = _state([GenerateChunk(prompt_logprobs=[-1.0, -2.0, -3.0], finish_reason="length")])
    meta = native_output(s, inp)["meta_info"]
    assert meta["input_token_logprobs"] == [[-1.0, 6], [-2.0, 7], [-3.0, 8]]
    inp0 = msgspec.structs.replace(inp, logprob_start_len=0)
    meta = native_output(s, inp0)["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, 5]
    assert meta["finish_reason"] == {"type": "length", "length": 0}


class _Tok:
    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids)


def test_completion_logprobs_offsets():
    out = completion_logprobs(
        [1, 2], [-0.1, -0.2], [[(1, -0.1)], [(2, -0.2)]], TokenText(_Tok()), 5
    )
    assert out == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"a": -0.1}, {"b": -0.2}],
        "text_offset": [5, 6],
    }
