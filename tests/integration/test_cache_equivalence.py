"""Correctness of cached KV is the product: greedy outputs with the radix cache on must equal the
outputs with it off, with the real model computing from pages the tree handed out.

The scheduler and the worker's ModelRunner are wired together in-process (the same objects the
processes run), so the test is deterministic and fast.
"""

from __future__ import annotations

import json
import random
import re
import time

import pytest

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.scheduler.main import advance
from radix_runtime.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runner_factory():
    from radix_runtime.worker.model_runner import ModelRunner

    cache = {}

    def make(args: ServerArgs):
        key = (
            args.model,
            args.load_format,
            args.model_config,
            args.page_size,
            args.max_total_tokens,
            args.grammar_fill_threads,
        )
        if key not in cache:
            cache[key] = ModelRunner(args)
        return cache[key]

    return make


def run(runner, args: ServerArgs, prompts, sampling, arrivals, namespaces=None, defer=False,
        early=False):  # fmt: skip
    """The scheduler process's step loop (`scheduler.main.advance`) with the runner in-process
    (`namespaces[i]`: request i's cache namespace, "" the public one): with the overlap schedule
    on (args.disable_overlap_schedule False) step N+1 is launched before step N is collected,
    its decoders feeding the tokens step N sampled from the device (from_last_sample). `defer`:
    launched as the worker process does, a constrained step's sampling queued after the step
    before it was collected (`ModelRunner.launch(defer_sample=True)`). `early` (the host tier):
    the copies queued by arrivals go to the runner at once (`ModelRunner.early_copies`), with
    the steps in flight, as the scheduler process sends what a request read during a step
    queued."""
    sched = Scheduler(args, runner.ready_info())
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    step = 0
    inflight = None  # (plan, runner.launch(batch))
    ahead_steps = 0
    deferred = 0

    def send(batch, _plan):
        nonlocal deferred
        launched = runner.launch(batch, defer_sample=defer and inflight is not None)
        deferred += launched.deferred is not None
        return launched

    def finish(plan, launched):
        sched.process_result(plan, runner.collect(launched))

    while pending or sched.has_work() or inflight is not None or sched.grammar_waiting:
        for i in [i for i in pending if arrivals[i] <= step]:
            sched.add_request(
                m.GenerateReq(
                    rid=f"r{i}",
                    input_ids=m.pack_ids(prompts[i]),
                    sampling=sampling,
                    cache_namespace=namespaces[i] if namespaces else "",
                )
            )
            pending.remove(i)
        if early:
            copies = sched.take_early_copies()
            if copies is not None:
                runner.early_copies(copies)
        # constrained requests: the worker compiles their grammar (on its threads) first
        for msg in sched.take_worker_messages():
            runner.compile_grammar(msg.kind, msg.text)
        if sched.grammar_waiting and not sched.has_work():
            time.sleep(0.002)
        for done in runner.finished_compiles():
            sched.grammar_compiled(done)
        inflight, _ = advance(sched, inflight, send, finish)
        ahead_steps += inflight is not None  # what stays in flight was built ahead
        for out in sched.take_outputs():
            assert out.error is None, out.error
            outputs[out.rid].extend(m.unpack_ids(out.new_ids).tolist())
        sched.check_integrity()
        step += 1
    # release every slot the runner still holds, so the next run starts clean
    runner.forward(
        m.ForwardBatch(step=0, reqs=[], released_slots=list(range(args.max_running_requests)))
    )
    assert (ahead_steps > 0) == (not args.disable_overlap_schedule)
    if defer and sampling.grammar is not None and ahead_steps and not args.enable_jump_forward:
        assert deferred > 0, "no constrained step had its sampling deferred"
    return outputs, sched


def tiny_args(**overrides) -> ServerArgs:
    """The tiny dummy model on the CPU, Python tree, one step at a time: the equivalence tests'
    baseline, which each varies by `replace`."""
    return ServerArgs(
        model="tiny-llama",
        load_format="dummy",
        model_config="tiny-llama",
        page_size=1,
        max_total_tokens=8192,
        chunked_prefill_size=64,
        max_running_requests=8,
        device="cpu",
        radix_tree_impl="python",
        disable_overlap_schedule=True,
    ).replace(**overrides)


def prompts_sharing_prefixes(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(96)]
    doc = [rng.randrange(3, vocab) for _ in range(64)]
    prompts = []
    for i in range(10):
        depth = i % 4
        p = system[: 24 * (depth + 1)] + (doc if depth == 3 else [])
        p = p + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 9))]
        prompts.append(p)
    prompts.append(list(prompts[1]))  # fully cached
    prompts.append(system[:30])  # inside an edge: forces a split
    return prompts


CASES = [
    # (model, load_format, model_config, page_size, pool tokens)
    ("default", "auto", None, 1, 8192),
    ("tiny-llama", "dummy", "tiny-llama", 1, 8192),
    ("tiny-llama", "dummy", "tiny-llama", 16, 8192),
]


@pytest.mark.parametrize("model,load_format,model_config,page_size,pool", CASES)
def test_greedy_cache_on_equals_off(
    runner_factory, model, load_format, model_config, page_size, pool
):
    base = ServerArgs(
        model=model,
        load_format=load_format,
        model_config=model_config,
        page_size=page_size,
        max_total_tokens=pool,
        chunked_prefill_size=64,
        max_running_requests=8,
        device="cpu",
        radix_tree_impl="python",
        disable_overlap_schedule=True,
    )
    runner = runner_factory(base)
    vocab = min(runner.ready_info().vocab_size, 49152)
    prompts = prompts_sharing_prefixes(vocab)
    arrivals = [i // 2 * 3 for i in range(len(prompts))]
    greedy = m.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    off, _ = run(runner, base.replace(disable_radix_cache=True), prompts, greedy, arrivals)
    on, sched = run(runner, base, prompts, greedy, arrivals)
    assert on == off
    assert sched.cached_tokens_total > 200
    overlap = base.replace(disable_overlap_schedule=False)
    assert run(runner, overlap, prompts, greedy, arrivals)[0] == off
    if model == "default":
        return  # the real model is slow on CPU; the runs below use the tiny one
    # stop tokens end requests mid-batch: the overlap schedule discards their run-ahead rows
    stops = sorted({tokens[3] for tokens in off.values()})[:3]
    stopping = m.SamplingParams(
        max_new_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=stops
    )
    off, _ = run(runner, base.replace(disable_radix_cache=True), prompts, stopping, arrivals)
    assert any(len(tokens) < 8 for tokens in off.values())
    assert run(runner, base, prompts, stopping, arrivals)[0] == off
    assert run(runner, overlap, prompts, stopping, arrivals)[0] == off
    # the same again with a repetition penalty: cached prefix tokens must still be penalized
    penal = m.SamplingParams(
        max_new_tokens=8,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.5,
        frequency_penalty=0.5,
    )
    off, _ = run(runner, base.replace(disable_radix_cache=True), prompts, penal, arrivals)
    on, _ = run(runner, base, prompts, penal, arrivals)
    assert on == off
    assert run(runner, overlap, prompts, penal, arrivals)[0] == off


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_cache_on_equals_off_with_cache_salts(runner_factory, page_size):
    """The same prompts spread over the public namespace and two salted ones (as the HTTP layer
    names them): every namespace computes its own copy of the shared prefixes, and the outputs
    still equal the cache-off run's."""
    base = tiny_args(page_size=page_size)
    runner = runner_factory(base)
    prompts = prompts_sharing_prefixes(runner.ready_info().vocab_size, seed=5)
    namespaces = [("", "salt:a", "tenant:t\x00salt:b")[i % 3] for i in range(len(prompts))]
    arrivals = [i // 2 * 3 for i in range(len(prompts))]
    greedy = m.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    off, _ = run(runner, base.replace(disable_radix_cache=True), prompts, greedy, arrivals)
    on, sched = run(runner, base, prompts, greedy, arrivals, namespaces)
    assert on == off
    _, public = run(runner, base, prompts, greedy, arrivals)
    # salted requests hit only their own namespace's prefixes: fewer hits than all-public
    assert 0 < sched.cached_tokens_total < public.cached_tokens_total


def test_hits_after_eviction_and_retraction(runner_factory):
    """A pool too small for the batch: prefixes are evicted, requests retracted and requeued,
    and the outputs still equal an unpressured cache-off run."""
    base = tiny_args()
    runner = runner_factory(base)
    prompts = prompts_sharing_prefixes(runner.ready_info().vocab_size, seed=3)
    arrivals = [0] * len(prompts)
    greedy = m.SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    off, _ = run(runner, base.replace(disable_radix_cache=True), prompts, greedy, arrivals)
    # admission reserving only the decoders' next pages (as SGLang's with a low token ratio)
    small = base.replace(max_total_tokens=260, schedule_conservativeness=0.0)
    small_runner = runner_factory(small)
    on, sched = run(small_runner, small, prompts, greedy, arrivals)
    assert on == off
    assert sched.retractions > 0
    ahead, sched = run(
        small_runner, small.replace(disable_overlap_schedule=False), prompts, greedy, arrivals
    )
    assert ahead == off
    assert sched.retractions > 0


# ---------------------------------------------------------------------------------------------
# constrained decoding: the grammar's state follows the same tokens whatever the cache, the
# schedule or the memory pressure (tiny dummy model over the default model's vocabulary)

CONSTRAINTS = {
    "regex": {"regex": r"[0-9]{1,3}( [a-z]{2,6}){3,40}"},
    "json_schema": {
        "json_schema": json.dumps(
            {
                "type": "object",
                "properties": {
                    "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 30},
                    "kind": {"enum": ["a", "b"]},
                },
                "required": ["ids", "kind"],
            }
        )
    },
}


def constrained_text(outputs: dict[str, list[int]], tokenizer) -> dict[str, str]:
    return {rid: tokenizer.decode(ids) for rid, ids in outputs.items()}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_greedy_cache_overlap_and_retraction(runner_factory, kind):
    """Cache on == off, overlap on == off, and a pool small enough to retract: the same
    constrained greedy outputs, every one a prefix of (or, stopped, a match of) the grammar."""
    from radix_runtime.tokenizer import load_tokenizer

    base = tiny_args()
    runner = runner_factory(base)
    prompts = prompts_sharing_prefixes(runner.ready_info().vocab_size, seed=5)
    arrivals = [i // 3 * 2 for i in range(len(prompts))]
    sampling = m.SamplingParams(max_new_tokens=24, temperature=0.0, **CONSTRAINTS[kind])
    off, _ = run(runner, base.replace(disable_radix_cache=True), prompts, sampling, arrivals)
    on, sched = run(runner, base, prompts, sampling, arrivals)
    assert on == off
    assert sched.cached_tokens_total > 100
    overlap = base.replace(disable_overlap_schedule=False)
    assert run(runner, overlap, prompts, sampling, arrivals)[0] == off
    # the worker process's order: the masks filled after the step before was collected, by
    # xgrammar's batch matcher on threads
    threaded = overlap.replace(grammar_fill_threads=2)
    assert (
        run(runner_factory(threaded), threaded, prompts, sampling, arrivals, defer=True)[0] == off
    )
    small = base.replace(max_total_tokens=300, schedule_conservativeness=0.0)
    small_runner = runner_factory(small)
    for args, defer in ((small, False), (small.replace(disable_overlap_schedule=False), True)):
        pressed, sched = run(small_runner, args, prompts, sampling, [0] * len(prompts), defer=defer)
        assert pressed == off
        assert sched.retractions > 0
    # the outputs follow the grammar (the model is random: only the grammar shapes them)
    texts = constrained_text(off, load_tokenizer("default"))
    if kind == "regex":
        for text in texts.values():
            assert re.fullmatch(r"[0-9]{1,3}( [a-z]{2,6}){0,40}( [a-z]{0,6})?", text), text
    else:
        assert all(text.startswith('{"ids": [') for text in texts.values()), texts
        assert any(len(ids) < 24 for ids in off.values()), "no output reached the grammar's end"
        for rid, text in texts.items():
            if len(off[rid]) < 24:
                assert json.loads(text)["kind"] in ("a", "b")


LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 16},
        "customer_age_in_years": {"type": "integer", "minimum": 0, "maximum": 120},
        "preferred_contact_method": {"enum": ["email", "phone"]},
    },
    "required": ["customer_full_name", "customer_age_in_years", "preferred_contact_method"],
}


def test_jump_forward_valid_fewer_steps_and_cache_equivalent(runner_factory):
    """--enable-jump-forward on the real model: the forced keys are appended without a decode
    step each (fewer steps), outputs still validate, and cache on == off, overlap on == off."""
    import jsonschema

    from radix_runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("default")
    base = ServerArgs(
        model="default",
        page_size=1,
        max_total_tokens=8192,
        chunked_prefill_size=64,
        max_running_requests=8,
        device="cpu",
        radix_tree_impl="python",
        disable_overlap_schedule=True,
    )
    runner = runner_factory(base)
    questions = ["Describe a customer as JSON.", "Invent a customer record as JSON."]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}]),
            add_special_tokens=False,
        )
        for q in questions
    ]
    sampling = m.SamplingParams(
        max_new_tokens=64, temperature=0.0, json_schema=json.dumps(LONG_KEYS)
    )
    arrivals = [0] * len(prompts)
    plain, plain_sched = run(runner, base, prompts, sampling, arrivals)
    jump_args = base.replace(enable_jump_forward=True)
    runner.sampler.jump_forward = True  # the runner is shared: its flag follows the run's args
    try:
        jumped, sched = run(runner, jump_args, prompts, sampling, arrivals)
        off, _ = run(
            runner, jump_args.replace(disable_radix_cache=True), prompts, sampling, arrivals
        )
        ahead, _ = run(
            runner,
            jump_args.replace(disable_overlap_schedule=False),
            prompts,
            sampling,
            arrivals,
            defer=True,
        )
    finally:
        runner.sampler.jump_forward = False
    assert jumped == off == ahead
    for outputs in (plain, jumped):
        for ids in outputs.values():
            jsonschema.validate(json.loads(tokenizer.decode(ids[:-1])), LONG_KEYS)
    assert sched.jumped_tokens >= 2 * 10
    assert sched.step_id < plain_sched.step_id
    # the boundary is re-tokenized: whatever the model sampled first (`{` or `{"`), the reply
    # opens with the tokenizer's own `{"` + key tokens
    key = '{"customer_full_name": "'
    for ids in jumped.values():
        assert ids[: len(tokenizer.encode(key, add_special_tokens=False))] == tokenizer.encode(
            key, add_special_tokens=False
        )


def test_prefill_cap_keeps_greedy_outputs(runner_factory):
    """--max-consecutive-prefill-steps 1 interleaves decode steps into a prefill burst: steps of
    other shapes, the same greedy tokens with the cache on, off and the overlap schedule."""
    base = tiny_args()
    runner = runner_factory(base)
    prompts = prompts_sharing_prefixes(runner.ready_info().vocab_size, seed=7)
    arrivals = [0, 0] + [2] * (len(prompts) - 2)
    greedy = m.SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    off, _ = run(runner, base.replace(disable_radix_cache=True), prompts, greedy, arrivals)
    _, free = run(runner, base, prompts, greedy, arrivals)
    capped = base.replace(max_consecutive_prefill_steps=1)
    on, sched = run(runner, capped, prompts, greedy, arrivals)
    assert on == off
    assert sched.decode_steps > free.decode_steps  # decode steps ran between prefill chunks
    overlap = capped.replace(disable_overlap_schedule=False)
    assert run(runner, overlap, prompts, greedy, arrivals)[0] == off
