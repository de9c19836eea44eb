"""The API additions on the real server (SmolLM2 on CPU): a trimmed stop string's tokens in
neither completion_tokens nor logprobs (streamed and whole alike), echo's prompt logprobs equal
/generate's, an unknown model is the SDK's NotFoundError, /health_generate."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

PROMPT = "Here is a short story about a dog named Max. Once upon a time,"


def _sse(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_a_trimmed_stop_strings_tokens_are_not_counted_streamed_or_not(default_server):
    base = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 1}
    with default_server.client() as c:
        free = c.post("/v1/completions", json=base).json()["choices"][0]
        tokens = free["logprobs"]["tokens"]
        # a stop string spanning two tokens in the middle of the reply, not seen before it
        k = next(
            i
            for i in range(2, len(tokens) - 2)
            if tokens[i].strip() and (tokens[i] + tokens[i + 1]) not in "".join(tokens[:i])
        )
        stop = tokens[k] + tokens[k + 1]
        body = {**base, "stop": [stop]}
        whole = c.post("/v1/completions", json=body).json()
        stream = c.post(
            "/v1/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == stop
    assert choice["text"] == "".join(tokens[:k])
    assert choice["logprobs"]["tokens"] == tokens[:k]
    assert whole["usage"]["completion_tokens"] == k
    events = _sse(stream.text)
    streamed = [t for e in events if e["choices"] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == tokens[:k]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == choice["text"]
    assert events[-1]["usage"]["completion_tokens"] == k


def test_echo_logprobs_equal_generates_prompt_logprobs(default_server):
    with default_server.client() as c:
        echo = c.post(
            "/v1/completions",
            json={"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0},
        ).json()
        ids = c.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        native = c.post(
            "/generate",
            json={
                "input_ids": ids,
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0},
            },
        ).json()
    choice = echo["choices"][0]
    assert choice["text"] == PROMPT
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(ids) == echo["usage"]["prompt_tokens"]
    want = [lp for lp, _ in native["meta_info"]["input_token_logprobs"]]
    assert lps[0] is None and want[0] is None
    assert lps[1:] == pytest.approx(want[1:], abs=1e-4)
    # the top alternative of each position is at least as likely as the prompt's token
    for lp, top in zip(lps[1:], choice["logprobs"]["top_logprobs"][1:]):
        assert max(top.values()) >= lp - 1e-4


def test_unknown_model_is_not_found_and_health_generate(default_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert info.value.code == "model_not_found"
    with default_server.client() as c:
        assert c.get("/health_generate").json() == {"status": "ok"}


def test_server_info_reports_each_process_garbage_collections(default_server):
    """Every process froze its startup objects out of collection (utils/gc_tuning.py) and reports
    its collections; the worker's come with its step results."""
    with default_server.client() as c:
        r = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
        gc = c.get("/get_server_info").json()["gc"]
    assert set(gc) == {"tokenizer", "scheduler", "worker"}
    for role, stats in gc.items():
        assert stats["frozen_objects"] > 1000, role  # at least the imports' objects
        assert stats["full_collections"] <= stats["collections"], role
        assert 0 <= stats["max_pause_s"] <= stats["pause_s"] or stats["collections"] == 0, role
