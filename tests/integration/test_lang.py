"""The frontend DSL (radix_runtime.lang) against a live server on the default model."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import radix_runtime as rr
from radix_runtime.lang.backend import Backend, GenResult, RoleMarkers, SelectResult
from radix_runtime.model_source import dummy_config_path
from radix_runtime.tokenizer.chat_template import render_chat

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LONG_SYSTEM = "You are a meticulous assistant for a library catalogue. " + " ".join(
    f"Rule {i}: always answer briefly, cite the shelf number, and never invent a book title."
    for i in range(1, 13)
)


@pytest.fixture(scope="module")
def endpoint(default_server):
    return rr.RuntimeEndpoint(default_server.url)


@rr.function
def qa(s, question, max_tokens=4):
    s += rr.system("You are a helpful assistant.")
    s += rr.user(question)
    s += rr.assistant(rr.gen("answer", max_tokens=max_tokens, temperature=0))


# ---------------------------------------------------------------------------------------------
# without a server: expressions and the batch prefix


class FakeBackend(Backend):
    """Echoes a fixed completion; records what it was sent."""

    def __init__(self) -> None:
        self.cached: list[str] = []
        self.markers = RoleMarkers.from_template(
            "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/]{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}"
        )

    def role_markers(self) -> RoleMarkers:
        return self.markers

    def generate(self, prompt, params, on_text=None) -> GenResult:
        if on_text is not None:
            on_text("o")
            on_text("k")
        return GenResult("ok", {"prompt": prompt})

    def select(self, prompt, choices) -> SelectResult:
        return SelectResult(len(choices) - 1, choices[-1], [0.0] * len(choices), [], 0)

    def cache_prefix(self, prompt: str) -> int:
        self.cached.append(prompt)
        return len(prompt)


def test_roles_messages_and_forks_offline():
    backend = FakeBackend()

    @rr.function
    def prog(s):
        s += rr.system("sys")
        s += rr.user("Q: " + rr.gen("q"))
        s += rr.assistant(rr.select("pick", choices=["a", "b"]))
        forks = s.fork(2)
        forks[0] += "left"
        forks[1] += "right"
        return [f.text() for f in forks.join()]

    state = prog.run(backend=backend)
    assert state.text() == "[system]sys[/][user]Q: ok[/][assistant]b[/]"
    assert state.messages() == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Q: ok"},
        {"role": "assistant", "content": "b"},
    ]
    assert state["q"] == "ok" and state["pick"] == "b"
    assert state.ret_value == [state.text() + "left", state.text() + "right"]
    assert backend.cached == [state.text()]  # the fork sent its prefix once


def test_batch_prefix_is_captured_up_to_the_first_gen():
    backend = FakeBackend()

    @rr.function
    def prog(s, topic):
        s += rr.system("shared system prompt")
        s += rr.user(f"Tell me about {topic}")
        s += rr.assistant(rr.gen("a"))

    prefix = prog.shared_prefix([{"topic": "cats"}, {"topic": "cars"}], backend)
    assert prefix == "[system]shared system prompt[/][user]Tell me about"
    states = prog.run_batch([{"topic": "cats"}, {"topic": "cars"}], backend=backend)
    assert backend.cached == [prefix]
    assert [s["a"] for s in states] == ["ok", "ok"]


def test_select_needs_choices():
    with pytest.raises(ValueError):
        rr.select("x", choices=[])
    with pytest.raises(ValueError):
        rr.select("x", choices=["a", ""])


def test_no_backend_is_a_clear_error():
    rr.set_default_backend(None)
    with pytest.raises(ValueError, match="no backend"):
        qa.run(question="hi")


# ---------------------------------------------------------------------------------------------
# against the default model


@pytest.mark.slow
def test_roles_follow_the_servers_chat_template(endpoint):
    template = endpoint.get_model_info()["chat_template"]
    state = qa.run(question="What is the capital of France?", backend=endpoint)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    answer = state["answer"]
    assert answer and messages[2]["content"] == answer
    # the prompt the gen saw is exactly what the chat route renders for the same messages
    prompt = render_chat(template, messages[:2], add_generation_prompt=True)
    assert state.text().startswith(prompt + answer)
    assert state.text() == render_chat(template, messages, add_generation_prompt=False)
    meta = state.get_meta_info("answer")
    assert 1 <= meta["completion_tokens"] <= 4

    # no system turn: the template's default system turn comes first, as in the chat route
    @rr.function
    def bare(s):
        s += rr.user("Hi")
        s += rr.assistant(rr.gen("reply", max_tokens=2, temperature=0))

    state = bare.run(backend=endpoint)
    assert state.messages()[0] == {"role": "user", "content": "Hi"}
    assert state.text() == render_chat(template, state.messages(), add_generation_prompt=False)


@pytest.mark.slow
def test_gen_plain_text_and_stop(endpoint):
    @rr.function
    def count(s):
        s += "Count: 1, 2, 3, 4," + rr.gen("rest", max_tokens=12, temperature=0, stop=",")

    state = count.run(backend=endpoint)
    assert "," not in state["rest"]
    assert state.text() == "Count: 1, 2, 3, 4," + state["rest"]
    assert state.get_meta_info("rest")["finish_reason"]["type"] in ("stop", "length")


@pytest.mark.slow
def test_select_agrees_with_direct_logprobs(endpoint):
    prompt = "Question: Is the sky blue on a clear day? Answer:"
    choices = [" yes", " no", " purple elephants"]

    @rr.function
    def pick(s):
        s += prompt + rr.select("answer", choices=choices)

    state = pick.run(backend=endpoint)
    assert state["answer"] in choices
    assert state.text() == prompt + state["answer"]
    scores = state.get_meta_info("answer")["normalized_logprobs"]

    # the same scores from raw /generate calls: mean logprob of the choice's tokens
    n_prompt = endpoint.request(
        "POST", "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0}}
    )["meta_info"]["prompt_tokens"]
    direct = []
    for choice in choices:
        out = endpoint.request(
            "POST",
            "/generate",
            {
                "text": prompt + choice,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": n_prompt,
            },
        )
        lps = [lp for lp, _ in out["meta_info"]["input_token_logprobs"]]
        direct.append(sum(lps) / len(lps))
    assert scores == pytest.approx(direct, abs=1e-2)
    assert state["answer"] == choices[max(range(len(choices)), key=direct.__getitem__)]


@pytest.mark.slow
def test_fork_sends_prefix_once_and_branches_differ(endpoint):
    endpoint.flush_cache()

    @rr.function
    def branches(s):
        s += rr.system(LONG_SYSTEM)
        s += rr.user("Name a colour.")
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += rr.assistant(rr.gen("c", max_tokens=3, temperature=1.0, seed=i))
        return forks

    state = branches.run(backend=endpoint)
    forks = state.ret_value
    prefix = state.text()
    n_prefix = endpoint.cache_prefix(prefix)
    for f in forks:
        assert f.text().startswith(prefix) and f["c"]
        assert f.get_meta_info("c")["cached_tokens"] >= n_prefix - 1
    assert "c" not in state  # branches do not write into the parent


@pytest.mark.slow
def test_run_batch_shares_a_long_system_prompt(endpoint):
    @rr.function
    def ask(s, question):
        s += rr.system(LONG_SYSTEM)
        s += rr.user(question)
        s += rr.assistant(rr.gen("answer", max_tokens=2, temperature=0))

    endpoint.flush_cache()
    before = endpoint.get_server_info()["cache"]["cached_tokens"]
    questions = [{"question": f"Where is book number {i}?"} for i in range(16)]
    states = ask.run_batch(questions, backend=endpoint, num_threads=16, progress_bar=True)
    after = endpoint.get_server_info()["cache"]["cached_tokens"]
    assert all(s["answer"] for s in states)
    shared = states[0].text().split("Where is book")[0]
    n_shared = endpoint.cache_prefix(shared)
    assert n_shared > 200
    assert after - before >= 15 * (n_shared - 2)


@pytest.mark.slow
def test_streamed_text_equals_final_text(endpoint):
    state = qa.run(question="Tell me a joke.", max_tokens=8, backend=endpoint, stream=True)
    pieces = list(state.text_iter())
    assert len(pieces) > 3
    assert "".join(pieces) == state.text()

    state = qa.run(question="Tell me a joke.", max_tokens=8, backend=endpoint, stream=True)

    async def collect():
        return [piece async for piece in state.text_async_iter("answer")]

    answer_pieces = asyncio.run(collect())
    assert "".join(answer_pieces) == state["answer"]


@pytest.mark.slow
def test_server_errors_surface_as_exceptions(endpoint):
    @rr.function
    def bad_temperature(s):
        s += "Hello" + rr.gen("x", max_tokens=2, temperature=-1)

    with pytest.raises(rr.ServerError, match="temperature must be in") as info:
        bad_temperature.run(backend=endpoint)
    assert info.value.status == 400 and info.value.param == "sampling_params.temperature"

    with pytest.raises(rr.ServerError, match="max_new_tokens is too large"):
        qa.run(question="hi", max_tokens=10**7, backend=endpoint)

    state = bad_temperature.run(backend=endpoint, stream=True)
    with pytest.raises(rr.ServerError, match="temperature"):
        list(state.text_iter())

    with pytest.raises(rr.ServerError, match="temperature"):
        bad_temperature.run_batch([{}, {}], backend=endpoint)


@pytest.mark.slow
def test_example_runs(default_server):
    out = subprocess.run(
        [sys.executable, "examples/multi_turn_chat.py", "--url", default_server.url]
        + ["--max-tokens", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("Assistant:") == 3


@pytest.mark.slow
def test_runtime_starts_and_stops_cleanly(tmp_path):
    # any model shows the process family start and stop: tiny-llama's shape with dummy weights
    # (a fraction of the default model's start-up), reading the default model's vocabulary
    config = json.loads(Path(dummy_config_path("tiny-llama")).read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 49152}))
    tiny = dict(model=str(tmp_path / "config.json"), load_format="dummy", tokenizer="default")
    with rr.Runtime(**tiny, max_total_tokens=4096) as runtime:
        server = psutil.Process(runtime.process.pid)
        family = [server, *server.children(recursive=True)]
        assert len(family) >= 3  # the HTTP front, the scheduler, the worker
        state = qa.run(question="Hi", max_tokens=2, backend=runtime)
        assert state["answer"]
    assert runtime.process is None
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive
