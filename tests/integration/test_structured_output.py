"""Constrained decoding end to end: JSON schemas, regexes and EBNF on the real default model
(SmolLM2, CPU) through the HTTP routes and the official `openai` client; bad grammars get a 400
and the server keeps serving; min_tokens.

The equivalence tests (cache on == off, overlap on == off, retraction, jump-forward) drive the
scheduler and the worker's ModelRunner in-process: see test_cache_equivalence.py; the masks under
every sampler setting: tests/unit/test_grammar.py (tests/gpu/test_grammar_gpu.py on CUDA).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "mood": {"type": "string", "enum": ["happy", "sad"]},
        },
        "required": ["colors", "mood"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["age", "score", "ok"],
    },
    "any_of_optional": {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "null"}]},
            "tag": {"type": "string", "maxLength": 8},
            "extra": {"type": "boolean"},
        },
        "required": ["id"],
    },
}
SEEDS = [1, 2, 3]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(default_server):
    with default_server.client() as c:
        yield c


def person_prompt(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with {what} as JSON."}]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_conformance_temperature_1(client, name):
    """n=3 seeded choices at temperature 1 for each schema: every output parses and validates
    (finishing by the grammar's end, not by length)."""
    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model=MODEL,
        messages=person_prompt("a record"),
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        temperature=1.0,
        seed=SEEDS[0],
        n=len(SEEDS),
        max_tokens=120,
    )
    assert len(r.choices) == len(SEEDS)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_regex_outputs_fullmatch_and_int_parses(http):
    cases = [
        (r"[0-9]{3}-[0-9]{4}", "A phone number: "),
        (r"(yes|no), because [a-z ]{1,20}\.", "Is the sky blue? Answer: "),
        (r"-?[1-9][0-9]{0,5}", "The answer, as an integer: "),
    ]
    outs = []
    for regex, prompt in cases:
        for seed in SEEDS:
            resp = http.post(
                "/generate",
                json={
                    "text": prompt,
                    "sampling_params": {
                        "regex": regex,
                        "temperature": 1.0,
                        "seed": seed,
                        "max_new_tokens": 40,
                    },
                },  # fmt: skip
            )
            assert resp.status_code == 200, resp.text
            outs.append((regex, resp.json()))
    for regex, out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(regex, out["text"]), (regex, out["text"])
    ints = [int(out["text"]) for regex, out in outs if regex.startswith("-?")]
    assert len(ints) == len(SEEDS)


def test_json_object_and_any_json(client, http):
    r = client.chat.completions.create(
        model=MODEL,
        messages=person_prompt("a person"),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=48,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the model may ramble in a string: still a JSON object's prefix
        assert r.choices[0].message.content.startswith("{")
    resp = http.post(
        "/generate",
        json={
            "text": "A JSON list of two numbers: ",
            "sampling_params": {"json_schema": "$$ANY$$", "temperature": 0, "max_new_tokens": 24},
        },
    )
    out = resp.json()
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        json.loads(out["text"])


def test_ebnf_and_stream_equals_non_stream(client, http):
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    full = http.post(
        "/generate",
        json={
            "text": "Q: Is water wet?\nA:",
            "sampling_params": {"ebnf": grammar, "temperature": 0},
        },
    ).json()
    assert full["text"] in ("The answer is yes.", "The answer is no.")
    assert full["meta_info"]["finish_reason"]["type"] == "stop"
    schema = SCHEMAS["bounded_numbers"]
    kwargs = dict(
        model=MODEL,
        messages=person_prompt("a person's age and score"),
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        temperature=0,
        max_tokens=64,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices
    ]
    assert "".join(pieces) == whole
    jsonschema.validate(json.loads(whole), schema)


def test_min_tokens_masks_eos(client):
    messages = [{"role": "user", "content": "Say hi."}]
    free = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=64
    )
    assert free.choices[0].finish_reason == "stop"
    k = free.usage.completion_tokens
    forced = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=64,
        extra_body={"min_tokens": k + 6},
    )
    assert forced.usage.completion_tokens >= k + 6
    # a grammar that can only stop wins over min_tokens (no token would be allowed otherwise)
    r = client.completions.create(
        model=MODEL,
        prompt="Yes or no? ",
        temperature=0,
        max_tokens=16,
        extra_body={"regex": "(yes|no)", "min_tokens": 10},
    )
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, "invalid_grammar"),
    ({"extra_body": {"regex": "(("}}, "invalid_grammar"),
    ({"extra_body": {"ebnf": 'root ::= "a" | b'}}, "invalid_grammar"),
    ({"extra_body": {"ebnf": "root ::= "}}, "invalid_grammar"),
    ({"extra_body": {"regex": "a" * 40000}}, "grammar_too_large"),
    ({"extra_body": {"regex": "a+", "ebnf": 'root ::= "a"'}}, None),
    ({"response_format": {"type": "xml"}}, "unsupported_value"),
]  # fmt: skip


@pytest.mark.parametrize("kwargs,code", BAD)
def test_bad_grammar_is_400_and_server_keeps_serving(client, kwargs, code):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=person_prompt("x"), max_tokens=8, **kwargs
        )
    err = info.value.body
    assert err["type"] == "invalid_request_error" and err["message"]
    if code is not None:
        assert err["code"] == code, err
    ok = client.chat.completions.create(
        model=MODEL,
        messages=person_prompt("x"),
        max_tokens=4,
        extra_body={"regex": "[a-z]{1,3}"},
    )
    assert re.fullmatch("[a-z]{1,3}", ok.choices[0].message.content)


def test_bad_grammar_stream_and_native_400(default_server, http):
    resp = http.post(
        "/generate",
        json={"text": "x", "stream": True, "sampling_params": {"json_schema": {"type": "foo"}}},
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_grammar"
    # many requests sharing one bad grammar, concurrently: each gets its 400, none hangs
    bodies = [{"text": f"x{i}", "sampling_params": {"regex": "[z-a]"}} for i in range(4)]
    with httpx.Client(base_url=default_server.url, timeout=60) as c:
        codes = [c.post("/generate", json=b).status_code for b in bodies]
    assert codes == [400] * 4
