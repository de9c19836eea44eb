"""End to end with the official `openai` client against `radix-runtime serve` on SmolLM2 (CPU)."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_and_model_info(default_server, model):
    assert model == "SmolLM2-135M-Instruct"
    info = httpx.get(f"{default_server.url}/get_model_info").json()
    assert info["context_length"] == 8192
    assert "<|im_start|>" in info["chat_template"]


def test_capital_of_france(client, model):
    def ask():
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )

    r = ask()
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    # the prompt's last token is always computed, so a prompt never hits in full...
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens
    # ...and asking again hits everything else (page size 1), with the same greedy answer
    again = ask()
    assert again.usage.prompt_tokens == r.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    assert again.choices[0].message.content == r.choices[0].message.content


def test_chat_stream_equals_non_stream(client, model):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0
    )
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_completions_stream_and_non_stream(client, model):
    r = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    text = r.choices[0].text
    assert text
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == text
    # the second identical prompt hits the cache
    again = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_second_turn_hits_the_whole_first_turn(client, model):
    turn1 = [{"role": "user", "content": "Tell me a fact about the Moon. Be brief."}]
    r1 = client.chat.completions.create(model=model, messages=turn1, max_tokens=20, temperature=0)
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And one about Mars?"},
    ]
    r2 = client.chat.completions.create(model=model, messages=turn2, max_tokens=8, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
        ({"messages": [{"role": "user", "content": "word " * 9000}]}, "messages"),
    ],
)
def test_bad_input_is_400_and_server_stays_up(default_server, body, param):
    r = httpx.post(f"{default_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert err["message"]
    if "word" in str(body):
        assert err["code"] == "context_length_exceeded"
    assert httpx.get(f"{default_server.url}/health").status_code == 200


def test_malformed_json_is_400(default_server):
    r = httpx.post(
        f"{default_server.url}/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_server_info_cache_fields(default_server):
    info = httpx.get(f"{default_server.url}/get_server_info").json()
    cache = info["cache"]
    for key in (
        "total_pages",
        "free_pages",
        "evictable_pages",
        "protected_pages",
        "page_size",
        "hit_rate",
    ):
        assert key in cache
    assert "running_requests" in info and "waiting_requests" in info
