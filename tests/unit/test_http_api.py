"""The HTTP front over the real TokenizerManager: every route, every bad input, SSE framing,
auth, n > 1, and aborts on client disconnect. Behind the manager's ZeroMQ sockets sits a scripted
scheduler (the same ipc endpoints, the same msgspec frames) that answers every request with
REPLY then EOS, one token per step — so stop strings, detokenization, logprobs and cached-token
reporting are the product's own. No model, no child processes."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import msgspec
import pytest
import uvicorn
from fastapi.testclient import TestClient
from http_support import (
    BOS,
    CACHED,
    CONTEXT,
    MODEL,
    REPLY,
    VOCAB,
    FakeTokenizer,
    RecordingManager,
    ScriptedScheduler,
    assert_error,
    chat_body,
    make_client,
    new_manager_for,
    running,
    sse_events,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radix_runtime.config import ServerArgs
from radix_runtime.server.http_server import build_app


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One scheduler, manager and client for the tests that leave the manager healthy."""
    ipc_dir = str(tmp_path_factory.mktemp("ipc"))
    scheduler = ScriptedScheduler(ipc_dir)
    manager = new_manager_for(ipc_dir)
    try:
        with make_client(manager) as client:
            yield scheduler, manager, client
    finally:
        scheduler.close()


@pytest.fixture
def sched(shared) -> ScriptedScheduler:
    shared[0].reset()
    return shared[0]


@pytest.fixture
def manager(shared, sched) -> RecordingManager:
    shared[1].inputs.clear()
    shared[1].draining = False
    return shared[1]


@pytest.fixture
def client(shared, manager) -> TestClient:
    return shared[2]


@pytest.fixture
def new_sched(tmp_path):
    """A scheduler of this test's own, for a manager it starts itself (other flags, its own
    event loop, or a manager that the test kills)."""
    scheduler = ScriptedScheduler(str(tmp_path))
    yield scheduler
    scheduler.close()


@pytest.fixture
def new_manager(new_sched, tmp_path) -> RecordingManager:
    return new_manager_for(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# happy paths


def test_chat_completion(client, manager):
    resp = client.post("/v1/chat/completions", json=chat_body(max_tokens=20, temperature=0))
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL
    assert body["system_fingerprint"] is None
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["message"] == {"role": "assistant", "content": REPLY}
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None
    prompt_ids = FakeTokenizer().encode("<user>hi<a>", add_special_tokens=False)
    # the EOS that ended the reply is a completion token, not text
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(REPLY) + 1,
        "total_tokens": len(prompt_ids) + len(REPLY) + 1,
        "prompt_tokens_details": {"cached_tokens": CACHED},
    }
    (inp,) = manager.inputs
    assert list(inp.input_ids) == prompt_ids  # template output, no second BOS
    assert inp.sampling.max_new_tokens == 20
    assert inp.sampling.temperature == 0.0
    assert inp.rid == body["id"]


def test_chat_sampling_params_plumbed(client, manager):
    resp = client.post(
        "/v1/chat/completions",
        json=chat_body(
            max_completion_tokens=5,
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            seed=7,
            frequency_penalty=0.5,
            presence_penalty=-0.5,
            repetition_penalty=1.1,
            stop=["xx", "yy"],
            stop_token_ids=[5, 6],
            ignore_eos=True,
            logit_bias={"10": -100, "11": 5.5},
            skip_special_tokens=False,
        ),
    )
    assert resp.status_code == 200, resp.text
    (inp,) = manager.inputs
    s = inp.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (
        5,
        0.7,
        0.9,
        40,
        0.05,
        7,
    )
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert s.stop_token_ids == [5, 6] and s.ignore_eos
    assert s.logit_bias == {10: -100.0, 11: 5.5}
    assert inp.stop == ["xx", "yy"]
    assert inp.skip_special_tokens is False
    assert resp.json()["choices"][0]["finish_reason"] == "length"


def test_chat_content_parts_and_developer_role(client, manager):
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "c"},
    ]
    resp = client.post("/v1/chat/completions", json={"messages": messages})
    assert resp.status_code == 200, resp.text
    expected = "<system>be brief<user>a\nb<assistant><user>c<a>"
    assert list(manager.inputs[0].input_ids) == FakeTokenizer().encode(expected, False)


def test_max_tokens_defaults_to_remaining_context(client, manager):
    client.post("/v1/chat/completions", json=chat_body())
    inp = manager.inputs[0]
    assert inp.sampling.max_new_tokens == CONTEXT - len(inp.input_ids)


def test_stop_string_trimmed(client):
    resp = client.post("/v1/completions", json={"prompt": "x", "stop": "wor"})
    choice = resp.json()["choices"][0]
    assert choice["text"] == "Hello "
    assert choice["finish_reason"] == "stop"
    assert choice["matched_stop"] == "wor"


def test_chat_stream(client):
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json=chat_body(stream=True, stream_options={"include_usage": True}),
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.read().decode())
    first, *middle, finish, usage = events
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in middle + [finish]) == REPLY
    assert all(e["choices"][0]["finish_reason"] is None for e in middle)
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert all(e["usage"] is None for e in [first, *middle, finish])
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == len(REPLY) + 1  # + EOS
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED}
    assert len({e["id"] for e in events}) == 1


def test_chat_stream_without_usage(client):
    resp = client.post("/v1/chat/completions", json=chat_body(stream=True))
    events = sse_events(resp.text)
    assert all("usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_n2_merges(client, manager):
    resp = client.post("/v1/chat/completions", json=chat_body(n=2, seed=5, max_tokens=4))
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["content"] == REPLY[:4] for c in body["choices"])
    # prompt counted once, completions summed
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == len(manager.inputs[0].input_ids)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED
    rids = {inp.rid for inp in manager.inputs}
    assert len(rids) == 2
    assert sorted(inp.sampling.seed for inp in manager.inputs) == [5, 6]


def test_chat_n2_stream(client):
    resp = client.post("/v1/chat/completions", json=chat_body(n=2, stream=True))
    events = sse_events(resp.text)
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in mine) == REPLY
        assert mine[-1]["finish_reason"] == "stop"


def test_chat_logprobs(client):
    resp = client.post(
        "/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=2, max_tokens=2)
    )
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["H", "e"]
    assert content[0]["logprob"] == -0.5
    assert content[0]["bytes"] == [ord("H")]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["H", "I"]
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5, -1.5]


def test_chat_logprobs_stream(client):
    resp = client.post(
        "/v1/chat/completions", json=chat_body(logprobs=True, max_tokens=2, stream=True)
    )
    events = sse_events(resp.text)
    tokens = [
        c["token"]
        for e in events
        if e["choices"][0]["logprobs"]
        for c in e["choices"][0]["logprobs"]["content"]
    ]
    assert tokens == ["H", "e"]


def test_completions_string_prompt(client, manager):
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 3})
    body = resp.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == REPLY[:3]
    assert body["choices"][0]["finish_reason"] == "length"
    assert manager.inputs[0].input_ids == (BOS, 97, 98, 99)
    assert body["usage"]["prompt_tokens"] == 4
    assert body["usage"]["total_tokens"] == 7


@pytest.mark.parametrize(
    "prompt,ids",
    [([5, 6, 7], [5, 6, 7]), (["abc"], [BOS, 97, 98, 99]), ([[5, 6]], [5, 6])],
)
def test_completions_prompt_forms(client, manager, prompt, ids):
    resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert list(manager.inputs[0].input_ids) == ids
    assert len(resp.json()["choices"]) == 1


def test_completions_batch_prompts_with_n(client, manager):
    resp = client.post("/v1/completions", json={"prompt": ["ab", [5, 6, 7]], "n": 2})
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 3 + 3  # each prompt once
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 6


def test_completions_logprobs(client):
    resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 1})
    lp = resp.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e", "l"]
    assert lp["token_logprobs"] == [-0.5] * 3
    assert lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"] == [{"H": -0.5}, {"e": -0.5}, {"l": -0.5}]


def test_completions_stream(client):
    resp = client.post(
        "/v1/completions",
        json={"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
    )
    events = sse_events(resp.text)
    *chunks, usage = events
    assert all(e["object"] == "text_completion" for e in events)
    assert "".join(e["choices"][0]["text"] for e in chunks) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(REPLY) + 1


def test_generate_text(client, manager):
    resp = client.post(
        "/generate",
        json={"text": "ab", "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
    )
    body = resp.json()
    assert body["text"] == REPLY[:3]
    assert body["output_ids"] == [ord(c) for c in REPLY[:3]]
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == 3
    assert meta["completion_tokens"] == 3
    assert meta["cached_tokens"] == CACHED
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["id"] == manager.inputs[0].rid
    assert "output_token_logprobs" not in meta


def test_generate_default_max_new_tokens_is_capped(client, manager):
    client.post("/generate", json={"input_ids": [5] * 10})
    assert manager.inputs[0].sampling.max_new_tokens == min(128, CONTEXT - 10)


def test_generate_logprobs(client, manager):
    resp = client.post(
        "/generate",
        json={
            "input_ids": [5, 6, 7, 8],
            "sampling_params": {"max_new_tokens": 2},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
            "rid": "my-rid",
        },
    )
    meta = resp.json()["meta_info"]
    assert meta["id"] == "my-rid" == manager.inputs[0].rid
    assert meta["output_token_logprobs"] == [[-0.5, ord("H")], [-0.5, ord("e")]]
    assert meta["input_token_logprobs"] == [[None, 5], [-1.0, 6], [-1.0, 7], [-1.0, 8]]
    assert meta["output_top_logprobs"][0] == [[-0.5, ord("H")], [-1.5, ord("H") + 1]]
    assert manager.inputs[0].logprob_start_len == 0


def test_generate_logprob_start_len_mid_prompt(client):
    resp = client.post(
        "/generate",
        json={
            "input_ids": [5, 6, 7, 8],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 2,
        },
    )
    meta = resp.json()["meta_info"]
    assert meta["input_token_logprobs"] == [[-1.0, 7], [-1.0, 8]]


def test_generate_prefill_only(client, manager):
    resp = client.post(
        "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 0}}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["text"] == "" and body["output_ids"] == []
    assert body["meta_info"]["finish_reason"]["type"] == "length"
    assert manager.inputs[0].sampling.max_new_tokens == 0


def test_generate_batch(client, manager):
    resp = client.post(
        "/generate",
        json={"text": ["a", "bb"], "sampling_params": {"max_new_tokens": 2}, "rid": ["r1", "r2"]},
    )
    body = resp.json()
    assert isinstance(body, list) and len(body) == 2
    assert [b["meta_info"]["id"] for b in body] == ["r1", "r2"]
    assert [b["meta_info"]["prompt_tokens"] for b in body] == [2, 3]


def test_generate_batch_input_ids(client):
    resp = client.post(
        "/generate", json={"input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 1}}
    )
    assert [b["meta_info"]["prompt_tokens"] for b in resp.json()] == [2, 1]


def test_generate_stream_cumulative(client):
    resp = client.post(
        "/generate", json={"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 4}}
    )
    events = sse_events(resp.text)
    assert [e["text"] for e in events] == ["H", "He", "Hel", "Hell"]
    assert events[-1]["output_ids"] == [ord(c) for c in "Hell"]
    assert events[0]["meta_info"]["finish_reason"] is None
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_stream_batch_has_index(client):
    resp = client.post(
        "/generate",
        json={"text": ["a", "b"], "stream": True, "sampling_params": {"max_new_tokens": 2}},
    )
    events = sse_events(resp.text)
    assert {e["index"] for e in events} == {0, 1}


def test_models_and_info_routes(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL
    assert models["data"][0]["object"] == "model"
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(client.get("/v1/models/other"), 404, param="model", code="model_not_found")
    info = client.get("/get_model_info").json()
    assert info == {
        "model_path": "/models/fake",
        "served_model_name": MODEL,
        "context_length": CONTEXT,
        "chat_template": None,
        "vocab_size": VOCAB,
    }
    server = client.get("/get_server_info").json()
    assert server["cache"]["hit_rate"] == 0.5  # the scheduler's numbers
    assert server["running_requests"] == 0
    assert server["context_length"] == CONTEXT
    assert server["page_size"] == 1  # static args merged in
    assert server["served_model_name"] == MODEL


def test_server_info_hides_api_key(new_manager):
    with make_client(new_manager, api_key="s3cret") as client:
        resp = client.get("/get_server_info", headers={"Authorization": "Bearer s3cret"})
    assert resp.status_code == 200
    assert "s3cret" not in resp.text


def test_health(new_manager):
    with make_client(new_manager) as client:
        _check_health(client, new_manager)


def _check_health(client, new_manager):
    assert client.get("/health").status_code == 200
    assert client.get("/health").json() == {"status": "ok"}
    new_manager.draining = True
    assert_error(client.get("/health"), 503, code="draining", type_="server_error")
    new_manager.draining = False
    new_manager.fail("the worker process exited with code 1")
    err = assert_error(client.get("/health"), 503, code="unhealthy", type_="server_error")
    assert "the worker process exited with code 1" in err["message"]


def test_flush_cache(client, sched):
    body = client.post("/flush_cache").json()
    assert body["success"] is True and body["dropped_tokens"] == 5 and body["kept_pages"] == 1
    assert client.get("/flush_cache").status_code == 200
    assert client.post("/reset_prefix_cache").json()["dropped_nodes"] == 2  # vLLM's name
    sched.flush_ok = False
    assert_error(client.post("/flush_cache"), 409)
    assert_error(client.post("/reset_prefix_cache"), 409)


# ---------------------------------------------------------------------------------------------
# bad inputs: 400 with the OpenAI error shape, never 422 / 500


def post_raw(client, path: str, content: bytes, **headers):
    return client.post(
        path, content=content, headers={"content-type": "application/json", **headers}
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"",
        b'{"a": NaN}',
        b'{"messages": "\xff\xfe"}',  # invalid UTF-8
        b'{"prompt": "\\ud800", "messages": "\\ud800", "text": "\\ud800"}',  # lone surrogate
        b'{"prompt": "\\udc00x", "text": "\\udc00x"}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
)
def test_malformed_json(client, path, content):
    assert_error(post_raw(client, path, content), 400)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
@pytest.mark.parametrize("content", [b"[]", b"1", b'"text"', b"null"])
def test_non_object_json(client, path, content):
    assert_error(post_raw(client, path, content), 400, code="invalid_type")


DROP = object()
CHAT_BAD = [
    ({"messages": []}, "messages", None),
    ({"messages": DROP}, "messages", "missing_required_parameter"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "missing_required_parameter"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", None),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", None),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0]",
        None,
    ),
    ({"messages": [{"role": "user", "content": "BAD"}]}, "messages", None),
    ({"model": 5}, "model", "invalid_type"),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"max_tokens": -1}, "max_tokens", None),
    ({"max_tokens": 1.5}, "max_tokens", "invalid_type"),
    ({"max_tokens": "10"}, "max_tokens", "invalid_type"),
    ({"max_tokens": True}, "max_tokens", "invalid_type"),
    ({"max_tokens": 10**30}, "max_tokens", None),
    ({"max_tokens": CONTEXT + 1}, "max_tokens", None),
    ({"max_completion_tokens": 0}, "max_completion_tokens", None),
    ({"max_tokens": CONTEXT - 2}, "messages", "context_length_exceeded"),
    ({"temperature": -0.1}, "temperature", None),
    ({"temperature": 2.5}, "temperature", None),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"top_p": 0}, "top_p", None),
    ({"top_p": 1.01}, "top_p", None),
    ({"top_k": 0}, "top_k", None),
    ({"top_k": -2}, "top_k", None),
    ({"min_p": 1.5}, "min_p", None),
    ({"frequency_penalty": 2.1}, "frequency_penalty", None),
    ({"presence_penalty": -3}, "presence_penalty", None),
    ({"repetition_penalty": 0}, "repetition_penalty", None),
    ({"seed": -1}, "seed", None),
    ({"seed": 2**64}, "seed", None),
    ({"n": 0}, "n", None),
    ({"n": 10**6}, "n", None),
    ({"n": 17}, "n", None),
    ({"stop": ["s"] * 17}, "stop", None),
    ({"stop": 5}, "stop", "invalid_type"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids[0]", None),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids[1]", None),
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc", None),
    ({"logit_bias": {str(VOCAB): 1}}, f"logit_bias.{VOCAB}", None),
    ({"logit_bias": {"5": 101}}, "logit_bias.5", None),
    ({"logit_bias": {"5": "x"}}, "logit_bias", "invalid_type"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", None),
    ({"top_logprobs": 2}, "top_logprobs", None),
    ({"logprobs": 3}, "logprobs", "invalid_type"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_type"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "unsupported_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", None),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
        "response_format.json_schema.schema",
        "invalid_type",
    ),
    (
        {"response_format": {"type": "json_object"}, "regex": "a+"},
        "response_format",
        None,
    ),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", None),
    ({"json_schema": "{not json"}, "json_schema", None),
    ({"json_schema": "[1, 2]"}, "json_schema", None),
    ({"regex": ""}, "regex", None),
    ({"regex": "a" * 40000}, "regex", "grammar_too_large"),
    ({"min_tokens": -1}, "min_tokens", None),
]


@pytest.mark.parametrize("patch,param,code", CHAT_BAD)
def test_chat_bad_input(client, manager, patch, param, code):
    body = {"messages": [{"role": "user", "content": "hi"}], **patch}
    body = {k: v for k, v in body.items() if v is not DROP}
    assert_error(client.post("/v1/chat/completions", json=body), 400, param=param, code=code)
    assert manager.inputs == []


@pytest.mark.parametrize(
    "path, body",
    [
        (
            "/v1/chat/completions",
            {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]},
        ),
        ("/v1/completions", {"model": "nope", "prompt": "x"}),
    ],
)
def test_unknown_model_is_404(client, manager, path, body):
    assert_error(client.post(path, json=body), 404, param="model", code="model_not_found")
    assert manager.inputs == []


@pytest.mark.parametrize("value", [b"1e999", b"-1e999", b"Infinity", b"-0.5"])
def test_temperature_not_finite_or_negative(client, value):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + value + b"}"
    err = assert_error(post_raw(client, "/v1/chat/completions", body), 400)
    assert err["param"] in ("temperature", None)  # None: malformed JSON (Infinity)


def test_chat_prompt_longer_than_context(client):
    body = {"messages": [{"role": "user", "content": "x" * CONTEXT}]}
    assert_error(
        client.post("/v1/chat/completions", json=body),
        400,
        param="messages",
        code="context_length_exceeded",
    )


COMPLETION_BAD = [
    ({}, "prompt", "missing_required_parameter"),
    ({"prompt": ""}, "prompt", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": [[]]}, "prompt[0]", None),
    ({"prompt": [""]}, "prompt[0]", None),
    ({"prompt": 5}, "prompt", "invalid_type"),
    ({"prompt": [1.5]}, "prompt[0]", None),
    ({"prompt": [True, 2]}, "prompt[0]", None),
    ({"prompt": [{"a": 1}]}, "prompt[0]", None),
    ({"prompt": [5, VOCAB]}, "prompt[1]", None),
    ({"prompt": [5, -1]}, "prompt[1]", None),
    ({"prompt": [[5], [VOCAB]]}, "prompt[1][0]", None),
    ({"prompt": "x" * CONTEXT}, "prompt", "context_length_exceeded"),
    ({"prompt": [5] * 10, "max_tokens": CONTEXT - 5}, "prompt", "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ({"prompt": "x", "logprobs": 21}, "logprobs", None),
    ({"prompt": "x", "logprobs": True}, "logprobs", "invalid_type"),
    ({"prompt": "x", "suffix": "y"}, "suffix", None),
    ({"prompt": ["a"] * 100, "n": 16}, "n", None),
    ({"prompt": "x", "temperature": 3}, "temperature", None),
]


@pytest.mark.parametrize("body,param,code", COMPLETION_BAD)
def test_completions_bad_input(client, manager, body, param, code):
    assert_error(client.post("/v1/completions", json=body), 400, param=param, code=code)
    assert manager.inputs == []


GENERATE_BAD = [
    ({}, "text", None),
    ({"text": "a", "input_ids": [5]}, "text", None),
    ({"text": ""}, "text", None),
    ({"text": []}, "text", None),
    ({"text": 5}, "text", "invalid_type"),
    ({"text": [5, 6]}, "text", None),
    ({"input_ids": []}, "input_ids", None),
    ({"input_ids": "abc"}, "input_ids", "invalid_type"),
    ({"input_ids": ["a"]}, "input_ids", None),
    ({"input_ids": [5, VOCAB]}, "input_ids[1]", None),
    ({"input_ids": [[5], []]}, "input_ids[1]", None),
    ({"input_ids": [5] * CONTEXT}, "input_ids", "context_length_exceeded"),
    (
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        "sampling_params.max_new_tokens",
        None,
    ),
    (
        {"text": "a", "sampling_params": {"max_new_tokens": 1.5}},
        "sampling_params.max_new_tokens",
        "invalid_type",
    ),
    (
        {"text": "a", "sampling_params": {"max_new_tokens": CONTEXT}},
        "text",
        "context_length_exceeded",
    ),
    (
        {"text": "a", "sampling_params": {"max_new_tokens": 10**9}},
        "sampling_params.max_new_tokens",
        None,
    ),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature", None),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p", None),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "sampling_params.top_k", None),
    (
        {"text": "a", "sampling_params": {"stop_token_ids": [VOCAB]}},
        "sampling_params.stop_token_ids[0]",
        None,
    ),
    (
        {"text": "a", "sampling_params": {"logit_bias": {"-1": 1.0}}},
        "sampling_params.logit_bias.-1",
        None,
    ),
    ({"text": "a", "sampling_params": "greedy"}, "sampling_params", "invalid_type"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len", None),
    ({"text": "a", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len", None),
    ({"text": "a", "top_logprobs_num": 21}, "top_logprobs_num", None),
    ({"text": ["a", "b"], "rid": "one"}, "rid", None),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid", None),
    ({"text": "a", "rid": ""}, "rid", None),
    ({"text": "a", "rid": 5}, "rid", "invalid_type"),
]


GENERATE_BAD += [
    (
        {"text": "a", "sampling_params": {"regex": "a", "json_schema": {}}},
        "sampling_params.json_schema",
        None,
    ),
    ({"text": "a", "sampling_params": {"json_schema": "{x"}}, "sampling_params.json_schema", None),
    ({"text": "a", "sampling_params": {"min_tokens": 10**9}}, "sampling_params.min_tokens", None),
    (
        {"text": "a", "sampling_params": {"ebnf": "x" * 40000}},
        "sampling_params.ebnf",
        "grammar_too_large",
    ),
]


@pytest.mark.parametrize("body,param,code", GENERATE_BAD)
def test_generate_bad_input(client, manager, body, param, code):
    assert_error(client.post("/generate", json=body), 400, param=param, code=code)
    assert manager.inputs == []


def test_no_tokenizer_rejects_text(new_manager):
    new_manager.tokenizer = None  # dummy weights: the new_manager has no tokenizer
    with make_client(new_manager) as client:
        assert_error(client.post("/generate", json={"text": "a"}), 400, code="no_tokenizer")
        chat = client.post("/v1/chat/completions", json=chat_body())
        assert_error(chat, 400, code="no_tokenizer")
        body = {"prompt": [5, 6], "max_tokens": 2, "logprobs": 0}
        resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:72", "token_id:101"]


def test_body_too_large(new_manager):
    def chunks():  # no Content-Length: the cap applies while reading
        for _ in range(10):
            yield b" " * 500

    with make_client(new_manager, max_body_bytes=1000) as client:
        body = json.dumps(chat_body(stop="x" * 2000)).encode()
        assert_error(post_raw(client, "/v1/chat/completions", body), 413)
        resp = client.post("/v1/chat/completions", content=chunks())
    assert_error(resp, 413)


def test_unknown_route_and_method(client):
    assert_error(client.get("/nope"), 404, code="not_found")
    assert_error(client.get("/v1/chat/completions"), 405, code="method_not_allowed")


def test_generation_error_passes_status_and_code(client, sched):
    sched.fail = ("request can never fit", "request_too_large")
    assert_error(
        client.post("/v1/chat/completions", json=chat_body()), 400, code="request_too_large"
    )
    assert_error(
        client.post("/v1/chat/completions", json=chat_body(stream=True)),
        400,
        code="request_too_large",
    )
    sched.fail = ("scheduler died", "server_error")
    assert_error(client.post("/generate", json={"text": "a"}), 503, type_="server_error")


@pytest.mark.timeout(60)
def test_unexpected_error_is_500_with_shape(client, sched):
    sched.garbage = True  # token ids that are not int32s: the manager fails unpacking them
    err = assert_error(
        client.post("/v1/chat/completions", json=chat_body()), 500, type_="server_error"
    )
    assert err["message"] == "internal server error"  # no traceback text leaks
    sched.garbage = False  # the malformed frames failed that request alone: the server serves
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_unhealthy_or_draining_rejects_new_requests(new_manager):
    with make_client(new_manager) as client:
        _check_unhealthy_or_draining(client, new_manager)


def _check_unhealthy_or_draining(client, new_manager):
    new_manager.draining = True
    assert_error(
        client.post("/v1/chat/completions", json=chat_body()),
        503,
        code="draining",
        type_="server_error",
    )
    new_manager.draining = False
    new_manager.fail("the scheduler process exited with code 1")
    assert_error(
        client.post("/generate", json={"text": "a"}), 503, code="unhealthy", type_="server_error"
    )
    assert new_manager.inputs == []


def test_unknown_fields_are_ignored(client):
    resp = client.post("/v1/chat/completions", json=chat_body(user="u1", metadata={"a": 1}))
    assert resp.status_code == 200


def test_emoji_surrogate_pair_is_fine(client, manager):
    resp = post_raw(
        client,
        "/v1/completions",
        b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}',
    )
    assert resp.status_code == 200, resp.text
    assert manager.inputs[0].input_ids == (BOS, 999)


# ---------------------------------------------------------------------------------------------
# auth


def test_auth(new_manager):
    with make_client(new_manager, api_key="s3cret") as client:
        _check_auth(client)
    assert new_manager.inputs and len(new_manager.inputs) == 1


def _check_auth(client):
    err = assert_error(
        client.post("/v1/chat/completions", json=chat_body()),
        401,
        code="invalid_api_key",
        type_="authentication_error",
    )
    assert err["param"] is None
    wrong = {"Authorization": "Bearer nope"}
    assert_error(client.get("/v1/models", headers=wrong), 401, type_="authentication_error")
    assert_error(
        client.get("/get_server_info", headers={"Authorization": "s3cret"}),
        401,
        type_="authentication_error",
    )
    assert_error(client.post("/flush_cache"), 401, type_="authentication_error")
    assert_error(client.post("/generate", json={"text": "a"}), 401, type_="authentication_error")
    assert client.get("/health").status_code == 200
    ok = {"Authorization": "Bearer s3cret"}
    assert client.get("/v1/models", headers=ok).status_code == 200
    assert client.post("/v1/chat/completions", json=chat_body(), headers=ok).status_code == 200


# ---------------------------------------------------------------------------------------------
# client disconnects abort the generation (driven at the ASGI level: deterministic)


async def _asgi_call(app, path: str, body: dict, disconnect_after: float):
    """Send a request, then report http.disconnect after ``disconnect_after`` seconds."""
    raw = msgspec.json.encode(body)
    sent: list[dict] = []
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


async def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_while_queued_aborts(new_manager, new_sched, stream, n):
    new_sched.hang = True
    app = build_app(new_manager, ServerArgs())

    async def main():
        async with running(new_manager):
            await _asgi_call(app, "/v1/chat/completions", chat_body(stream=stream, n=n), 0.05)
            await _wait_for(lambda: len(new_sched.aborted) == n)

    asyncio.run(main())
    assert sorted(new_sched.aborted) == sorted(inp.rid for inp in new_manager.inputs)


def test_disconnect_mid_stream_aborts(new_manager, new_sched):
    new_sched.hang_after_first = True
    app = build_app(new_manager, ServerArgs())

    async def main():
        async with running(new_manager):
            sent = await _asgi_call(app, "/generate", {"text": "a", "stream": True}, 0.05)
            await _wait_for(lambda: new_sched.aborted)
        return sent

    sent = asyncio.run(main())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert any(b'"text":"H"' in msg.get("body", b"") for msg in sent)
    assert new_sched.aborted == [new_manager.inputs[0].rid]


def test_finished_generation_is_not_aborted(client, manager, sched):
    client.post("/v1/chat/completions", json=chat_body(n=2))
    client.post("/v1/chat/completions", json=chat_body(stream=True))
    client.get("/get_server_info")  # a round trip behind any abort the requests sent
    rids = {inp.rid for inp in manager.inputs}
    assert len(rids) == 3 and not rids & set(sched.aborted)


def test_stream_error_after_first_chunk_is_an_sse_error_event(client, sched):
    sched.fail_after_first = ("retracted too often", "aborted")
    events = sse_events(client.post("/generate", json={"text": "a", "stream": True}).text)
    assert events[0]["text"] == "H"
    assert events[-1]["error"]["code"] == "aborted"


# ---------------------------------------------------------------------------------------------
# a real uvicorn server and the official openai client


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_server(new_manager):
    args = ServerArgs(host="127.0.0.1", port=_free_port(), log_level="warning")
    app = build_app(new_manager, args, lifespan=lambda app: running(new_manager))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{args.port}"
    server.should_exit = True
    thread.join(10)


def test_openai_client(live_server, new_manager):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0)

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert chat.choices[0].message.content == REPLY[:5]
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens_details.cached_tokens == CACHED

    parts, usage = [], None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == REPLY
    assert usage.completion_tokens == len(REPLY) + 1  # + EOS

    completion = client.completions.create(model=MODEL, prompt="abc", max_tokens=3)
    assert completion.choices[0].text == REPLY[:3]
    assert completion.usage.prompt_tokens == 4

    # an unknown model is a 404, as OpenAI answers: the SDK raises NotFoundError
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_live_disconnect_aborts(live_server, new_manager, new_sched):
    # streaming: read the first chunk, hang up
    new_sched.hang_after_first = True
    with (
        httpx.Client(base_url=live_server) as http,
        http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as resp,
    ):
        assert resp.status_code == 200
        next(resp.iter_bytes())
    _wait_until(lambda: len(new_sched.aborted) == 1)

    # non-streaming, stuck in the queue: the client times out and hangs up
    new_sched.hang = True
    with httpx.Client(base_url=live_server, timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"prompt": "x"})
    _wait_until(lambda: len(new_sched.aborted) == 2)
    assert new_sched.aborted == [inp.rid for inp in new_manager.inputs]


def _wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------
# fuzz: arbitrary values in known fields never produce anything but 200 or 400


_FIELD_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
_FIELDS = [
    "model",
    "messages",
    "prompt",
    "text",
    "input_ids",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "n",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "stream",
    "stream_options",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "rid",
    "ignore_eos",
    "skip_special_tokens",
]
_BASES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/generate": {"text": "hi"},
}


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(sorted(_BASES)),
    patch=st.dictionaries(st.sampled_from(_FIELDS), _FIELD_VALUES, max_size=3),
)
def test_fuzz_fields_never_500(client, path, patch):
    resp = client.post(path, json={**_BASES[path], **patch})
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert_error(resp, 400)


# ---------------------------------------------------------------------------------------------
# constrained decoding fields reach the sampling params (their runtime is tested in
# tests/integration/test_structured_output.py)

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize(
    "patch,field,text",
    [
        ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}'),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            "json_schema",
            json.dumps(SCHEMA),
        ),
        ({"response_format": {"type": "text"}, "regex": "[ab]+"}, "regex", "[ab]+"),
        ({"ebnf": 'root ::= "x"'}, "ebnf", 'root ::= "x"'),
        ({"json_schema": json.dumps(SCHEMA)}, "json_schema", json.dumps(SCHEMA)),
    ],
)
def test_chat_grammar_fields(client, manager, patch, field, text):
    resp = client.post("/v1/chat/completions", json=chat_body(min_tokens=3, **patch))
    assert resp.status_code == 200, resp.text
    (inp,) = manager.inputs
    assert getattr(inp.sampling, field) == text  # property order kept: b before a
    assert inp.sampling.min_tokens == 3
    others = {"regex", "json_schema", "ebnf"} - {field}
    assert all(getattr(inp.sampling, f) is None for f in others)


def test_completions_response_format(client, manager):
    body = {"prompt": "hi", "response_format": {"type": "json_object"}, "n": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert [i.sampling.json_schema for i in manager.inputs] == ['{"type": "object"}'] * 2


@pytest.mark.parametrize(
    "value,expected",
    [
        (SCHEMA, json.dumps(SCHEMA)),
        (json.dumps(SCHEMA), json.dumps(SCHEMA)),
        ("$$ANY$$", "$$ANY$$"),
    ],
)
def test_generate_json_schema_object_or_string(client, manager, value, expected):
    body = {"text": "a", "sampling_params": {"json_schema": value, "min_new_tokens": 2}}
    assert client.post("/generate", json=body).status_code == 200
    (inp,) = manager.inputs
    assert inp.sampling.json_schema == expected
    assert inp.sampling.min_tokens == 2
    assert inp.sampling.grammar == (
        ("json", "") if value == "$$ANY$$" else ("json_schema", expected)
    )
