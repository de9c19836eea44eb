"""Bad input against the real server: every malformed request is a 400 (413 for size) with the
OpenAI error body, never a 500; and text split across tokens streams exactly as it returns."""

from __future__ import annotations

import json
import os

import pytest
from reliability_support import assert_error_shape, assert_no_leak, record

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
MSGS = [{"role": "user", "content": "hi"}]
VOCAB = 49152  # SmolLM2
CONTEXT = 8192


def chat(**fields) -> dict:
    return {"messages": MSGS, **fields}


# (id, route, body: a JSON-able object or raw bytes, status, the `param` the error names or None,
#  the `code` or None to skip)
# fmt: off
CASES = [
    # bodies that are not JSON objects
    ("array body", CHAT, b"[]", 400, None, "invalid_type"),
    ("string body", CHAT, b'"hello"', 400, None, "invalid_type"),
    ("number body", COMPLETIONS, b"42", 400, None, "invalid_type"),
    ("null body", GENERATE, b"null", 400, None, "invalid_type"),
    ("bool body", GENERATE, b"true", 400, None, "invalid_type"),
    ("empty body", CHAT, b"", 400, None, "invalid_json"),
    ("truncated JSON", COMPLETIONS, b'{"prompt": "hi"', 400, None, "invalid_json"),
    ("form body", GENERATE, b"text=hi", 400, None, "invalid_json"),
    ("deeply nested", GENERATE, b'{"text":' + b"[" * 50000 + b"]" * 50000 + b"}", 400, None, None),
    # wrong field types
    ("messages a string", CHAT, {"messages": "hi"}, 400, "messages", "invalid_type"),
    ("message without role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role", None),
    ("max_tokens a string", CHAT, chat(max_tokens="10"), 400, "max_tokens", "invalid_type"),
    ("temperature a string", CHAT, chat(temperature="hot"), 400, "temperature", "invalid_type"),
    ("stream a string", CHAT, chat(stream="yes"), 400, "stream", "invalid_type"),
    ("prompt a number", COMPLETIONS, {"prompt": 123}, 400, "prompt", "invalid_type"),
    ("prompt an object", COMPLETIONS, {"prompt": {"a": 1}}, 400, "prompt", "invalid_type"),
    ("prompt mixed ids", COMPLETIONS, {"prompt": [1, "a"]}, 400, None, None),
    ("text a number", GENERATE, {"text": 5}, 400, "text", "invalid_type"),
    ("sampling_params a list", GENERATE, {"text": "hi", "sampling_params": [1]}, 400, "sampling_params", "invalid_type"),
    ("stop a number", CHAT, chat(stop=5), 400, "stop", "invalid_type"),
    ("too many stops", CHAT, chat(stop=[f"s{i}" for i in range(100)]), 400, "stop", None),
    ("image content part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content[0]", None),
    # empty prompts
    ("empty completion prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt", None),
    ("empty id list", COMPLETIONS, {"prompt": []}, 400, "prompt", None),
    ("no messages", CHAT, {"messages": []}, 400, "messages", None),
    ("empty text", GENERATE, {"text": ""}, 400, "text", None),
    ("empty input_ids", GENERATE, {"input_ids": []}, 400, "input_ids", None),
    # over the context
    ("ids over the context", COMPLETIONS, {"prompt": [100] * (CONTEXT + 1)}, 400, "prompt", "context_length_exceeded"),
    ("text over the context", COMPLETIONS, {"prompt": "hello " * (CONTEXT + 10)}, 400, "prompt", "context_length_exceeded"),
    ("prompt + max_tokens over", COMPLETIONS, {"prompt": [100] * 8000, "max_tokens": 500}, 400, "prompt", "context_length_exceeded"),
    ("generate over the context", GENERATE, {"input_ids": [100] * (CONTEXT + 1)}, 400, "input_ids", "context_length_exceeded"),
    # max_tokens
    ("max_tokens 0", CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens negative", CHAT, chat(max_tokens=-1), 400, "max_tokens", None),
    ("max_tokens huge", CHAT, chat(max_tokens=10**9), 400, "max_tokens", None),
    ("max_tokens beyond int64", COMPLETIONS, {"prompt": "hi", "max_tokens": 10**30}, 400, "max_tokens", None),
    ("max_tokens float", CHAT, chat(max_tokens=1.5), 400, "max_tokens", "invalid_type"),
    ("max_completion_tokens 0", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
    ("max_new_tokens negative", GENERATE, {"text": "hi", "sampling_params": {"max_new_tokens": -3}}, 400, "sampling_params.max_new_tokens", None),
    ("max_new_tokens huge", GENERATE, {"text": "hi", "sampling_params": {"max_new_tokens": 10**12}}, 400, "sampling_params.max_new_tokens", None),
    # temperature
    ("temperature NaN", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None, "invalid_json"),
    ("temperature Infinity", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400, None, "invalid_json"),
    ("temperature 1e400", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}', 400, "temperature", None),
    ("temperature negative", CHAT, chat(temperature=-0.5), 400, "temperature", None),
    ("temperature above 2", CHAT, chat(temperature=2.5), 400, "temperature", None),
    ("generate temperature above 2", GENERATE, {"text": "hi", "sampling_params": {"temperature": 3}}, 400, "sampling_params.temperature", None),
    # top_p / top_k / n
    ("top_p 0", CHAT, chat(top_p=0), 400, "top_p", None),
    ("top_p negative", CHAT, chat(top_p=-0.1), 400, "top_p", None),
    ("top_p above 1", CHAT, chat(top_p=1.5), 400, "top_p", None),
    ("top_k 0", CHAT, chat(top_k=0), 400, "top_k", None),
    ("top_k -2", CHAT, chat(top_k=-2), 400, "top_k", None),
    ("top_k float", CHAT, chat(top_k=2.5), 400, "top_k", "invalid_type"),
    ("n 0", CHAT, chat(n=0), 400, "n", None),
    ("n huge", CHAT, chat(n=10**6), 400, "n", None),
    ("n beyond int64", COMPLETIONS, {"prompt": "hi", "n": 10**20}, 400, "n", None),
    ("n x prompts too many", COMPLETIONS, {"prompt": ["a"] * 100, "n": 16}, 400, "n", None),
    # token ids outside the vocabulary
    ("input_ids = vocab", GENERATE, {"input_ids": [VOCAB]}, 400, "input_ids[0]", None),
    ("input_ids negative", GENERATE, {"input_ids": [5, -1]}, 400, "input_ids[1]", None),
    ("prompt id huge", COMPLETIONS, {"prompt": [1, 10**10]}, 400, "prompt[1]", None),
    ("stop_token_ids = vocab", CHAT, chat(stop_token_ids=[VOCAB]), 400, "stop_token_ids[0]", None),
    ("stop_token_ids negative", GENERATE, {"text": "hi", "sampling_params": {"stop_token_ids": [-5]}}, 400, "sampling_params.stop_token_ids[0]", None),
    ("logit_bias id = vocab", CHAT, chat(logit_bias={str(VOCAB): 1}), 400, f"logit_bias.{VOCAB}", None),
    ("logit_bias id negative", CHAT, chat(logit_bias={"-1": 1}), 400, "logit_bias.-1", None),
    ("logit_bias key not an id", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias.abc", None),
    ("logit_bias value huge", CHAT, chat(logit_bias={"5": 1000}), 400, "logit_bias.5", None),
    # text that is not valid Unicode
    ("lone high surrogate", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, None, "invalid_json"),
    ("lone low surrogate", COMPLETIONS, b'{"prompt": "\\udc00"}', 400, None, "invalid_json"),
    ("reversed surrogates", CHAT, b'{"messages": [{"role": "user", "content": "\\udc00\\ud800"}]}', 400, None, "invalid_json"),
    ("surrogate as UTF-8 bytes", CHAT, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', 400, None, "invalid_json"),
    ("invalid UTF-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None, "invalid_json"),
    ("overlong UTF-8", GENERATE, b'{"text": "\xc0\xaf"}', 400, None, "invalid_json"),
    ("truncated UTF-8", GENERATE, b'{"text": "\xe4\xbd"}', 400, None, "invalid_json"),
]
# fmt: on


@pytest.fixture(scope="module")
def checked_server(default_server):
    start = os.path.getsize(default_server.log_path)
    yield default_server
    # after the whole battery: nothing leaked, nothing was logged as an unhandled error
    assert_no_leak(default_server)
    with open(default_server.log_path, errors="replace") as f:
        f.seek(start)
        assert "unhandled error" not in f.read()
    record("bad input: malformed requests", cases=len(CASES), status="400 with the error body")


@pytest.mark.parametrize(
    "route, body, status, param, code", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_request(checked_server, route, body, status, param, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    with checked_server.client() as c:
        r = c.post(route, headers={"content-type": "application/json"}, **kw)
    err = assert_error_shape(r, status)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def test_oversized_body(checked_server):
    """A body over --max-body-bytes (32 MiB by default) is a 413, whether it declares its length
    or streams in chunks."""
    big = b'{"text": "' + b"a" * (33 * 2**20) + b'"}'

    def chunks():
        for _ in range(40):
            yield b"a" * 2**20

    with checked_server.client() as c:
        declared = c.post(GENERATE, content=big, headers={"content-type": "application/json"})
        streamed = c.post(GENERATE, content=chunks(), headers={"content-type": "application/json"})
    for r in (declared, streamed):
        assert assert_error_shape(r, 413)["code"] == "request_too_large"
    assert_no_leak(checked_server)
    record("bad input: oversized body", declared=declared.status_code, chunked=streamed.status_code)


def test_hostile_but_valid_sampling(checked_server):
    """Values at the edges of the valid ranges run without crashing anything, and a temperature
    too small for float32 logits / temperature is greedy (not NaN probabilities)."""
    edge = [
        {"temperature": 1e-30},
        {"temperature": 2.0, "top_p": 1e-9},
        {"top_k": 10**9},
        {"repetition_penalty": 1e-30},
        {"repetition_penalty": 2.0, "frequency_penalty": 2.0, "presence_penalty": -2.0},
        {"min_p": 1.0},
        {"seed": 2**63 - 1},
        {"logit_bias": {str(i): 100 for i in range(300)}},
    ]
    prompt = {"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": True}
    with checked_server.client() as c:
        for fields in edge:
            r = c.post(COMPLETIONS, json={**prompt, **fields})
            assert r.status_code == 200, (fields, r.text)
        greedy = c.post(COMPLETIONS, json={**prompt, "temperature": 0}).json()
        for tiny in (1e-6, 1e-40, 1e-300):
            r = c.post(COMPLETIONS, json={**prompt, "temperature": tiny}).json()
            assert r["choices"][0]["text"] == greedy["choices"][0]["text"], (tiny, r, greedy)
    assert_no_leak(checked_server)
    record(
        "bad input: edge-of-range sampling values",
        requests=len(edge),
        status=200,
        tiny_temperature="greedy",
    )


# ---------------------------------------------------------------------------------------------
# multibyte characters split across tokens

# few-shot prompts the small model answers with CJK or emoji, each character 3-4 byte tokens
_ZH = "English: cat\nChinese: 猫\nEnglish: water\nChinese: 水\nEnglish: {}\nChinese:"
_EMOJI = "Word: sun\nEmoji: ☀️\nWord: heart\nEmoji: ❤️\nWord: {}\nEmoji:"
_COPY = "Text: 猫和狗\nCopy: 猫和狗\nText: {}\nCopy:"
MULTIBYTE_PROMPTS = [
    _ZH.format("dog"),
    _EMOJI.format("cat"),
    _COPY.format("你好，世界！"),
    _COPY.format("こんにちは🌍"),
]


def test_multibyte_text_streams_whole(checked_server):
    """A character split across tokens never shows up half-done (no U+FFFD) in the stream, and
    the stream adds up to exactly the non-streamed text (greedy)."""
    split_chars = 0
    with checked_server.client() as c:
        for prompt in MULTIBYTE_PROMPTS:
            body = {"prompt": prompt, "temperature": 0, "max_tokens": 16, "stop": ["\n"]}
            r = c.post(COMPLETIONS, json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            whole = out["choices"][0]["text"]
            pieces, finish = [], None
            with c.stream("POST", COMPLETIONS, json={**body, "stream": True}) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        pieces.append(choice["text"])
                        finish = choice["finish_reason"] or finish
            assert "".join(pieces) == whole, (prompt, pieces, whole)
            assert finish == out["choices"][0]["finish_reason"] == "stop", (prompt, whole)
            assert "\ufffd" not in whole and not any("\ufffd" in p for p in pieces), pieces
            wide = [ch for ch in whole if len(ch.encode()) > 1]
            assert wide, (prompt, whole)
            # more tokens than characters (the trimmed stop string's token is not counted):
            # characters were split
            assert out["usage"]["completion_tokens"] > len(whole), (prompt, whole, out)
            split_chars += len(wide)
    assert_no_leak(checked_server)
    record(
        "multibyte: streamed == non-streamed",
        prompts=len(MULTIBYTE_PROMPTS),
        multibyte_chars=split_chars,
        replacement_chars=0,
    )
