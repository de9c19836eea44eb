"""The DSL's SGLang surface without a model: what each construct sends to the server.

``RecordingEndpoint`` is the real ``RuntimeEndpoint`` with its HTTP transport replaced: every
``/generate`` body is recorded and answered with a canned completion, so these tests pin the
request payloads (sampling defaults, constraints, logprob options) and the state semantics.
"""

from __future__ import annotations

import json
import re
import threading

import pytest

import radix_runtime as sgl
from radix_runtime.lang.backend import RoleMarkers, RuntimeEndpoint

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/]{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


class RecordingEndpoint(RuntimeEndpoint):
    def __init__(self, reply: str = "42") -> None:
        super().__init__("http://127.0.0.1:9")
        self.reply = reply
        self.bodies: list[dict] = []
        self.cached: list[str] = []
        self.flushed = 0
        self._lock = threading.Lock()

    def role_markers(self) -> RoleMarkers:
        return RoleMarkers.from_template(TEMPLATE)

    def _answer(self, text: str) -> dict:
        return {"text": self.reply, "output_ids": [], "meta_info": {"prompt": text}}

    def request(self, method: str, path: str, body=None):
        if path == "/flush_cache":
            self.flushed += 1
            return {"success": True}
        if path == "/get_server_info":
            return {"cache": {"cached_tokens": 0}}
        assert path == "/generate", path
        sp = body.get("sampling_params", {})
        if sp.get("max_new_tokens") == 0:
            self.cached.append(body["text"])
            return {"text": "", "meta_info": {"prompt_tokens": len(body["text"])}}
        with self._lock:
            self.bodies.append(body)
        if isinstance(body["text"], list):
            return [self._answer(t) for t in body["text"]]
        return self._answer(body["text"])

    def stream(self, path: str, body: dict):
        with self._lock:
            self.bodies.append(body)
        for i in range(1, len(self.reply) + 1):
            yield {"text": self.reply[:i], "meta_info": {}}

    @property
    def sampling(self) -> list[dict]:
        return [b["sampling_params"] for b in self.bodies]


@pytest.fixture
def ep():
    return RecordingEndpoint()


@sgl.function
def two_gens(s, question):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("a"))
    s += sgl.assistant(sgl.gen("b", max_tokens=5, temperature=0.7))


SAMPLING = dict(
    temperature=0,
    max_new_tokens=64,
    top_p=0.9,
    top_k=20,
    min_p=0.05,
    frequency_penalty=0.1,
    presence_penalty=0.2,
    stop=["\n"],
    stop_token_ids=[7],
    ignore_eos=True,
)


def test_run_sampling_kwargs_are_gen_defaults_not_function_arguments(ep):
    state = two_gens.run(question="hi", backend=ep, **SAMPLING)
    assert state["a"] == "42"
    first, second = ep.sampling
    assert first == {
        "temperature": 0,
        "max_new_tokens": 64,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.2,
        "stop": ["\n"],
        "stop_token_ids": [7],
        "ignore_eos": True,
    }
    # a gen's own settings win over the run's
    assert second["max_new_tokens"] == 5 and second["temperature"] == 0.7
    assert second["top_k"] == 20


def test_run_batch_and_direct_call_take_sampling_kwargs(ep):
    states = two_gens.run_batch(
        [{"question": "q1"}, ("q2",)], backend=ep, temperature=0, max_new_tokens=8
    )
    assert [s["a"] for s in states] == ["42", "42"]
    assert sorted(sp["temperature"] for sp in ep.sampling) == [0, 0, 0.7, 0.7]
    assert sorted(sp["max_new_tokens"] for sp in ep.sampling) == [5, 5, 8, 8]

    ep.bodies.clear()
    state = two_gens(question="q3", backend=ep, temperature=0, max_new_tokens=3)
    assert isinstance(state, sgl.ProgramState) and state["b"] == "42"
    assert ep.sampling[0] == {"temperature": 0, "max_new_tokens": 3}

    state = two_gens(question="q4", backend=ep, stream=True)
    assert "".join(state.text_iter()) == state.text()
    assert ep.bodies[-1]["text"].endswith("[assistant]")

    # generator style yields in input order
    gen_states = list(two_gens.run_batch([("x",), ("y",)], backend=ep, generator_style=True))
    assert [s.messages()[0]["content"] for s in gen_states] == ["x", "y"]

    with pytest.raises(TypeError, match="unexpected keyword"):
        two_gens.run_batch([("x",)], backend=ep, temprature=0)


def test_function_parameters_named_like_gen_knobs_still_reach_the_function(ep):
    # max_tokens is gen's name, not a run-level sampling keyword: it stays an argument
    @sgl.function
    def prog(s, max_tokens):
        s += "x" + sgl.gen("y", max_tokens=max_tokens)

    prog.run(max_tokens=3, backend=ep)
    assert ep.sampling[0] == {"max_new_tokens": 3}


def test_constraints_map_to_server_fields(ep):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}

    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("r", regex=r"[a-z]+")
        s += "b" + sgl.gen("j", json_schema=schema)
        s += "c" + sgl.gen("js", json_schema='{"type": "string"}')
        s += "d" + sgl.gen("i", dtype=int)
        s += "e" + sgl.gen("f", dtype="float")
        s += "f" + sgl.gen("s", dtype=str)
        s += "g" + sgl.gen("bo", dtype=bool)
        s += "h" + sgl.gen_int("gi", 4)
        s += "i" + sgl.gen_string("gs")
        s += "j" + sgl.gen("m", 16, 3)  # positional: name, max_tokens, min_tokens
        s += "k" + sgl.gen("e", ebnf='root ::= "yes" | "no"')

    prog.run(backend=ep)
    sp = {b["text"][-1]: b["sampling_params"] for b in ep.bodies}
    assert sp["a"] == {"regex": "[a-z]+"}
    assert json.loads(sp["b"]["json_schema"]) == schema
    assert sp["c"] == {"json_schema": '{"type": "string"}'}
    assert sp["d"] == {"regex": sgl.REGEX_INT, "stop": [" ", "\n"]}
    assert sp["e"] == {"regex": sgl.REGEX_FLOAT, "stop": [" ", "\n"]}
    assert sp["f"] == {"regex": sgl.REGEX_STR}
    assert sp["g"] == {"regex": sgl.REGEX_BOOL}
    assert sp["h"] == {"regex": sgl.REGEX_INT, "stop": [" ", "\n"], "max_new_tokens": 4}
    assert sp["i"] == {"regex": sgl.REGEX_STR}
    assert sp["j"] == {"max_new_tokens": 16, "min_tokens": 3}
    assert sp["k"] == {"ebnf": 'root ::= "yes" | "no"'}
    for value in ("-12", "7 "):
        assert re.fullmatch(sgl.REGEX_INT, value)
    assert re.fullmatch(sgl.REGEX_FLOAT, "3.25") and re.fullmatch(sgl.REGEX_STR, '"a b"')


def test_bad_gen_arguments_fail_at_once():
    with pytest.raises(ValueError, match="one output constraint"):
        sgl.gen("x", regex="a", dtype=int)
    with pytest.raises(ValueError, match="regular expression"):
        sgl.gen("x", regex="(")
    with pytest.raises(ValueError, match="not valid JSON"):
        sgl.gen("x", json_schema="{")
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=list)
    with pytest.raises(NotImplementedError, match="stop_regex"):
        sgl.gen("x", stop_regex="a")
    with pytest.raises(NotImplementedError, match="greedy_token_selection"):
        sgl.gen("x", choices=["a"], choices_method=sgl.greedy_token_selection)
    for make in (lambda: sgl.image("cat.png"), lambda: sgl.video("cat.mp4", 4)):
        with pytest.raises(NotImplementedError, match="vision"):
            make()
    with pytest.raises(NotImplementedError, match="return_text_in_logprobs"):
        two_gens.run(question="q", backend=RecordingEndpoint(), return_text_in_logprobs=True)


def test_logprob_options_and_n(ep):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
        s += "y" + sgl.gen("b", n=3)

    state = prog.run(backend=ep)
    first, second = ep.bodies
    assert first["return_logprob"] and first["top_logprobs_num"] == 2
    assert first["logprob_start_len"] == 0
    assert second["text"] == [second["text"][0]] * 3
    assert state["b"] == ["42"] * 3 and state.text() == "x42y42"


def test_role_scopes_var_scope_and_set_var(ep):
    @sgl.function
    def prog(s):
        with s.system():
            s += "be brief"
        with s.user():
            s += "Q: "
            with s.var_scope("question"):
                s += "why?"
        s["asked"] = True
        s.set_var("n", 1)
        with s.assistant():
            s += sgl.gen("answer")
        s += sgl.user_begin() + "bye" + sgl.user_end()

    state = prog.run(backend=ep)
    assert state.text() == "[system]be brief[/][user]Q: why?[/][assistant]42[/][user]bye[/]"
    assert state["question"] == "why?" and state["asked"] is True and state.get_var("n") == 1
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user"]
    assert state.messages()[2]["content"] == "42"

    @sgl.function
    def nested(s):
        with s.user():
            s += sgl.assistant("x")

    with pytest.raises(ValueError, match="inside a user turn"):
        nested.run(backend=ep)


def test_forks_lambda_list_join_modes_and_copy(ep):
    @sgl.function
    def prog(s):
        s += "Tips:"
        forks = s.fork(3, position_ids_offset=[0, 5, 10])
        forks += lambda i: f" tip{i}:"
        forks += [" a", " b", " c"]
        forks += sgl.gen("detail")
        forks.join()  # gather_variable
        gathered = s["detail"]
        forks2 = s.fork(2)
        forks2 += lambda i: f" [{i}]"
        forks2.join(mode="concate_and_append")
        with s.copy() as c:
            c += sgl.gen("copied")
        return gathered, [f.position_ids_offset for f in forks]

    state = prog.run(backend=ep)
    gathered, offsets = state.ret_value
    assert gathered == ["42", "42", "42"]
    assert offsets == [[0], [5], [10]]
    assert state.text() == "Tips: [0] [1]"
    assert state["copied"] == ["42"]
    assert ep.cached[0] == "Tips:"  # the fork sent its prefix once
    with pytest.raises(ValueError, match="one offset per branch"):
        sgl.ProgramState(ep).fork(2, position_ids_offset=[1])
    with pytest.raises(ValueError, match="join mode"):
        sgl.ProgramState(ep).fork(1).join(mode="nope")


def test_global_config_default_backend_and_module_helpers(ep):
    sgl.set_default_backend(ep)
    try:
        assert sgl.global_config.default_backend is ep
        assert sgl.flush_cache() is True and ep.flushed == 1
        assert sgl.get_server_info()["cache"]["cached_tokens"] == 0
        state = two_gens.run(question="q")
        assert state["a"] == "42"
        sgl.global_config.enable_precache_with_tracing = False
        two_gens.run_batch([("q1",), ("q2",)])
        assert ep.cached == []
    finally:
        sgl.global_config.enable_precache_with_tracing = True
        sgl.set_default_backend(None)
    assert sgl.flush_cache() is False and sgl.get_server_info() is None


def test_bind_and_decorator_options(ep):
    @sgl.function(num_api_spec_tokens=8)
    def prog(s, a, b):
        s += a + b + sgl.gen("x")

    state = prog.bind(b="!").run(a="hi", backend=ep)
    assert state.text() == "hi!42"
    with pytest.raises(TypeError):
        prog.bind(c=1)
