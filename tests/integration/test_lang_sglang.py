"""SGLang-style programs (``import radix_runtime as sgl``) against the default model.

Each program is written the way an SGLang user writes it and exercises a part of the SGLang
surface: run-level sampling keywords, direct calls, role scopes, variable scopes, fork lambdas and
join modes, copies, typed and constrained generation, module-level helpers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import radix_runtime as sgl
from radix_runtime.messages import SamplingParams
from radix_runtime.tokenizer.chat_template import render_chat

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_GRAMMAR = "regex" in SamplingParams.__struct_fields__
needs_grammar = pytest.mark.skipif(not HAS_GRAMMAR, reason="needs the constrained-decoding runtime")


@pytest.fixture(scope="module")
def backend(default_server):
    endpoint = sgl.RuntimeEndpoint(default_server.url)
    sgl.set_default_backend(endpoint)
    yield endpoint
    sgl.set_default_backend(None)


@sgl.function
def capital(s, country):
    s += sgl.system("Answer with one short sentence.")
    s += sgl.user(f"What is the capital of {country}?")
    s += sgl.assistant(sgl.gen("answer"))


def test_run_level_sampling_keywords_reach_every_gen(backend):
    # temperature=0 and max_new_tokens come from run(), not from gen(); they are not arguments
    # of the program (which would raise TypeError)
    a = capital.run(country="France", temperature=0, max_new_tokens=6)
    b = capital(country="France", temperature=0, max_new_tokens=6)  # a direct call is a run
    assert isinstance(b, sgl.ProgramState)
    assert a["answer"] == b["answer"] and a["answer"]
    assert a.get_meta_info("answer")["completion_tokens"] <= 6
    states = capital.run_batch(
        [{"country": "France"}, ("Italy",)], temperature=0, max_new_tokens=6, progress_bar=False
    )
    assert all(s["answer"] for s in states)
    assert all(s.get_meta_info("answer")["completion_tokens"] <= 6 for s in states)
    streamed = capital(country="France", temperature=0, max_new_tokens=6, stream=True)
    assert "".join(streamed.text_iter("answer")) == a["answer"]


def test_role_scopes_var_scope_set_var_and_positional_gen(backend):
    @sgl.function
    def interview(s, name):
        with s.system():
            s += "You are a polite interviewer."
        with s.user():
            s += "My name is "
            with s.var_scope("who"):
                s += name
            s += ". Greet me."
        s["turns"] = 1
        with s.assistant():
            s += sgl.gen("greeting", 5)  # positional max_tokens
        s.set_var("turns", 2)

    state = interview.run(name="Ada", temperature=0)
    template = backend.get_model_info()["chat_template"]
    assert state["who"] == "Ada" and state["turns"] == 2
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"]
    assert state.messages()[1]["content"] == "My name is Ada. Greet me."
    assert state.text() == render_chat(template, state.messages(), add_generation_prompt=False)
    assert state.get_meta_info("greeting")["completion_tokens"] <= 5


def test_fork_lambdas_lists_join_modes_and_copy(backend):
    @sgl.function
    def tips(s, topic):
        s += sgl.user(f"Give one tip about {topic}.")
        forks = s.fork(2, position_ids_offset=[0, 0])
        forks += lambda i: sgl.assistant(f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=4))
        forks += [sgl.user("Shorter?"), sgl.user("Longer?")]
        forks.join()  # gather_variable: s["tip"] is the list of both branches' tips
        notes = s.fork(2)
        notes += lambda i: f" note{i}"
        notes.join(mode="concate_and_append")
        with s.copy() as c:
            c += sgl.assistant(sgl.gen("extra", max_tokens=3))
        return [f.text() for f in forks]

    state = tips.run(topic="sleep", temperature=0)
    assert isinstance(state["tip"], list) and len(state["tip"]) == 2
    for i, (tip, text) in enumerate(zip(state["tip"], state.ret_value)):
        assert tip and f"Tip {i + 1}:{tip}" in text
    assert "Shorter?" in state.ret_value[0] and "Longer?" in state.ret_value[1]
    assert state.text().endswith(" note0 note1")
    assert len(state["extra"]) == 1 and "extra" not in state.text()


def test_module_level_helpers_and_global_config(backend):
    assert sgl.global_config.default_backend is backend
    assert sgl.flush_cache() is True
    info = sgl.get_server_info()
    assert info["served_model_name"] and "cache" in info


@needs_grammar
def test_typed_and_constrained_generation(backend):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    }

    @sgl.function
    def profile(s):
        s += sgl.user("Invent a person. How old are they?")
        s += sgl.assistant("Age: " + sgl.gen_int("age", 4))
        s += sgl.user("Height in metres?")
        s += sgl.assistant(sgl.gen("height", max_tokens=6, dtype=float))
        s += sgl.user("Are they a student?")
        s += sgl.assistant(sgl.gen("student", max_tokens=3, dtype=bool))
        s += sgl.user("Their town?")
        s += sgl.assistant(sgl.gen_string("town", 12))
        s += sgl.user("A phone number?")
        s += sgl.assistant(sgl.gen("phone", max_tokens=16, regex=r"\d{3}-\d{4}"))
        s += sgl.user("As JSON?")
        s += sgl.assistant(sgl.gen("json", max_tokens=48, json_schema=json.dumps(schema)))
        s += sgl.user("Say more.")
        s += sgl.assistant(sgl.gen("long", max_tokens=12, min_tokens=10))

    state = profile.run(temperature=0)
    int(state["age"])
    float(state["height"])
    assert state["student"] in ("True", "False")
    assert re.fullmatch(sgl.REGEX_STR, state["town"])
    assert re.fullmatch(r"\d{3}-\d{4}", state["phone"])
    import jsonschema

    jsonschema.validate(json.loads(state["json"]), schema)
    assert state.get_meta_info("long")["completion_tokens"] >= 10


def test_features_without_a_vision_model_raise_clearly(backend):
    @sgl.function
    def describe(s, path):
        s += sgl.user(sgl.image(path) + "What is this?")

    with pytest.raises(NotImplementedError, match="no vision model"):
        describe.run(path="cat.png")


def _run_example(url: str, name: str, *extra: str) -> str:
    out = subprocess.run(
        [sys.executable, f"examples/{name}", "--url", url, *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_sglang_style_example_runs(default_server):
    out = _run_example(default_server.url, "sglang_style.py", "--max-tokens", "4")
    assert out.count("batch:") == 2 and "tips: Here are two tips:\n1." in out


@needs_grammar
def test_structured_and_tool_calling_examples_run(default_server):
    out = _run_example(default_server.url, "sglang_structured.py")
    assert "city:" in out and "book:" in out and "legs:" in out
    out = _run_example(default_server.url, "tool_calling.py", "--max-tokens", "8")
    assert "finish_reason: tool_calls" in out and "call: get_weather(" in out
