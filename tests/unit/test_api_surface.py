"""What the tools people point at a server expect, over the real manager and a scripted
scheduler (tests/http_support.py): echo with logprobs
(lm-evaluation-harness's local-completions), whole-number floats for integer fields,
/health_generate, and the served OpenAPI schema and docs (its fuzz test: test_openapi_fuzz.py)."""

from __future__ import annotations

import json

import pytest
from http_support import REPLY, assert_error, served, sse_events

PROMPT = "abc"


def completion(client, **body) -> dict:
    resp = client.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_with_logprobs_returns_the_prompt_tokens_first(server, max_tokens):
    manager = server.manager
    body = completion(server.client, echo=True, logprobs=2, max_tokens=max_tokens)
    (inp,) = manager.inputs
    assert inp.logprob_start_len == 0 and inp.sampling.max_new_tokens == max_tokens
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT + REPLY[:max_tokens]
    lp = choice["logprobs"]
    prompt_ids = inp.input_ids  # BOS + one token per character
    assert lp["tokens"] == ["", "a", "b", "c", *REPLY[:max_tokens]]
    assert lp["token_logprobs"] == [None, -1.0, -1.0, -1.0] + [-0.5] * max_tokens
    assert lp["top_logprobs"][0] is None  # nothing comes before the first token
    for tok, top in zip(prompt_ids[1:], lp["top_logprobs"][1 : len(prompt_ids)]):
        assert top == {chr(tok): -1.0, chr(tok + 1): -2.0}
    assert len(lp["text_offset"]) == len(lp["tokens"])
    assert lp["text_offset"][len(prompt_ids) :] == list(
        range(len(PROMPT), len(PROMPT) + max_tokens)
    )
    assert body["usage"]["completion_tokens"] == max_tokens


def test_echo_without_logprobs_and_with_token_ids(server):
    manager, client = server.manager, server.client
    body = completion(client, echo=True, max_tokens=2)
    assert body["choices"][0]["text"] == PROMPT + REPLY[:2]
    assert body["choices"][0]["logprobs"] is None
    assert manager.inputs[0].logprob_start_len == -1  # nothing extra computed
    ids = [ord(c) for c in "xyz"]
    body = completion(client, prompt=ids, echo=True, max_tokens=1, n=2)
    assert [c["text"] for c in body["choices"]] == ["xyz" + REPLY[0]] * 2


def test_echo_streams_what_it_returns(server):
    client = server.client
    full = completion(client, echo=True, logprobs=1, max_tokens=4)["choices"][0]
    resp = client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4, "stream": True},
    )
    events = [e for e in sse_events(resp.text) if e != "[DONE]"]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    tokens = [t for e in events if e["choices"] for t in e["choices"][0]["logprobs"]["tokens"]]
    offsets = [
        o for e in events if e["choices"] for o in e["choices"][0]["logprobs"]["text_offset"]
    ]
    assert text == full["text"]
    assert tokens == full["logprobs"]["tokens"]
    assert offsets == full["logprobs"]["text_offset"]


def test_max_tokens_0_needs_echo(server):
    assert_error(
        server.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}),
        400,
        param="max_tokens",
    )


# ---- whole-number floats for integer fields


@pytest.mark.parametrize(
    "path, body, check",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 4.0}, "max_new_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 2.0, "max_tokens": 1}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "max_completion_tokens": 3.0, "top_k": 5.0}, "max_new_tokens"),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 3.0, "seed": 7.0}},
         "max_new_tokens"),
    ],
)  # fmt: skip
def test_whole_number_floats_are_integers(server, path, body, check):
    manager = server.manager
    resp = server.client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    inp = manager.inputs[0]
    if check == "n":
        assert len(manager.inputs) == 2
    else:
        assert inp.sampling.max_new_tokens in (3, 4)
        assert isinstance(inp.sampling.max_new_tokens, int)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 4.5}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "4"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": [1.0, 2.0], "max_tokens": 1.0}, "prompt[0]"),
        ("/generate", {"input_ids": [5], "sampling_params": {"stop_token_ids": [1.0]}},
         "sampling_params.stop_token_ids[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "logprobs": 1.0}, "logprobs"),
    ],
)  # fmt: skip
def test_everything_else_stays_strict(server, path, body, param):
    manager = server.manager
    err = assert_error(server.client.post(path, json=body), 400)
    assert err["param"] == param
    assert manager.inputs == []


# ---- /health_generate


def test_health_generate_runs_one_token(server):
    manager, client = server.manager, server.client
    resp = client.get("/health_generate")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    (inp,) = manager.inputs
    assert inp.sampling.max_new_tokens == 1 and inp.input_ids


def test_health_generate_is_503_when_the_model_fails_or_the_server_is_unhealthy():
    with served() as s:
        s.sched.fail = ("the worker died", "server_error")
        err = s.client.get("/health_generate")
        assert_error(err, 503, code="unhealthy", type_="server_error")
        s.sched.fail = None
        s.manager.fail("the worker process exited with code 1")
        assert s.client.get("/health_generate").status_code == 503


def test_health_generate_needs_the_key():
    with served(api_key="k") as s:
        assert s.client.get("/health_generate").status_code == 401
        ok = s.client.get("/health_generate", headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200


# ---- OpenAPI and docs


def test_openapi_and_docs_are_served(server):
    client = server.client
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].startswith("#/components/schemas/")
    comps = schema["components"]["schemas"]
    assert "cache_salt" in comps["CompletionRequest"]["properties"]
    assert comps["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["type"] == "integer"
    docs = client.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    json.dumps(schema)  # plain JSON


def test_disable_docs():
    with served(disable_docs=True) as s:
        assert s.client.get("/openapi.json").status_code == 404
        assert s.client.get("/docs").status_code == 404


# ---- vLLM's tokenizer endpoints (lm-evaluation-harness finds and uses them)


def test_tokenize_detokenize_and_tokenizer_info(server):
    client = server.client
    resp = client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False})
    assert resp.json() == {"count": 2, "max_model_len": 64, "tokens": [97, 98]}
    assert client.post("/tokenize", json={"prompt": "ab"}).json()["tokens"] == [1, 97, 98]
    assert client.post("/detokenize", json={"tokens": [97, 98]}).json() == {"prompt": "ab"}
    assert_error(client.post("/detokenize", json={"tokens": [5000]}), 400, param="tokens[0]")
    assert_error(client.post("/tokenize", json={"prompt": 3}), 400, param="prompt")
    err = client.post("/tokenize", json={"prompt": "a", "model": "other"})
    assert_error(err, 404, code="model_not_found")
    assert client.get("/tokenizer_info").status_code == 200


# ---- fields we do not implement are refused by name, not ignored


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/generate", {"image_data": "abc"}, "image_data"),
        ("/generate", {"lora_path": "adapter"}, "lora_path"),
        ("/generate", {"session_params": {"id": "s"}}, "session_params"),
        ("/generate", {"return_hidden_states": True}, "return_hidden_states"),
        ("/generate", {"sampling_params": {"n": 2}}, "sampling_params.n"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
    ],
)
def test_unimplemented_fields_are_400(server, path, extra, param):
    body = {"text": "x"} if path == "/generate" else {"prompt": "x"}
    assert_error(server.client.post(path, json={**body, **extra}), 400, param=param)
    assert server.manager.inputs == []
    ok = {**body, "sampling_params": {"n": 1}} if path == "/generate" else {**body, "best_of": 1}
    assert server.client.post(path, json=ok).status_code == 200
