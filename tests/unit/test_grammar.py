"""Constrained sampling on the CPU: grammar masks under every sampler setting, min_tokens, the
compile cache, and xgrammar's view of our tokenizer (the same checks run on CUDA in
tests/gpu/test_grammar_gpu.py)."""

from __future__ import annotations

import time

import pytest
import torch
from grammar_steps import (
    bits,
    check_constrained,
    check_min_tokens,
    check_padded_vocabulary,
    grammar_cache,
)

from radix_runtime.grammar.matcher import clear_tokens

pytestmark = pytest.mark.slow  # loads the default model's tokenizer

CPU = torch.device("cpu")


def test_mask_holds_for_every_sampler_setting():
    check_constrained(CPU)


def test_min_tokens_masks_eos_and_stop_ids():
    check_min_tokens(CPU)


def wait_compiled(cache, n: int, timeout: float = 60.0):
    done, deadline = [], time.monotonic() + timeout
    while len(done) < n and time.monotonic() < deadline:
        done += cache.take_finished()
        time.sleep(0.005)
    return done


def test_compile_cache_and_errors():
    _, cache = grammar_cache()
    cache.take_finished()
    text = '{"type": "object", "properties": {"x": {"type": "integer"}}}'
    cache.submit("json_schema", text)
    (first,) = wait_compiled(cache, 1)
    assert first.error is None and not first.cache_hit
    hits = cache.hits
    cache.submit("json_schema", text)
    (second,) = wait_compiled(cache, 1)
    assert second.cache_hit and cache.hits == hits + 1
    cache.submit("regex", "[z-a]")
    cache.submit("ebnf", 'root ::= "a" missing_rule')
    errors = {d.kind: d.error for d in wait_compiled(cache, 2)}
    assert errors["regex"].startswith("invalid regex") and "/project" not in errors["regex"]
    assert errors["ebnf"].startswith("invalid EBNF grammar")
    cache.submit("regex", "[z-a]")  # an invalid grammar is cached too: reported at once
    (again,) = wait_compiled(cache, 1)
    assert again.cache_hit and again.error == errors["regex"]


def test_tokenizer_info_matches_our_tokenizer():
    tokenizer, cache = grammar_cache()
    info = cache.info
    assert info.vocab_size == tokenizer.vocab_size
    assert info.stop_token_ids == [2]
    # special tokens (<|im_start|> ...) are never allowed inside a grammar
    assert tokenizer.token_to_id("<|im_start|>") in info.special_token_ids
    decoded = info.decoded_vocab
    for tid in (tokenizer.encode(" hello", add_special_tokens=False)[0], 33, 1000):
        assert decoded[tid] == tokenizer.token_bytes(tid)


def test_clear_tokens_keeps_a_row_that_can_only_stop():
    row = torch.zeros(4, dtype=torch.int32)
    row[0] = (1 << 2) | (1 << 5)
    row[1] = -(2**31)  # token 63: the sign bit of word 1
    clear_tokens(row, [2, 63])
    assert bits(row) == {5}
    only_stop = torch.zeros(4, dtype=torch.int32)
    only_stop[0] = 1 << 2
    clear_tokens(only_stop, [2, 63])
    assert bits(only_stop) == {2}  # the grammar can only stop: min_tokens gives way


def _masks_over_steps(fill_threads: int, steps: int = 12) -> list[torch.Tensor]:
    """The bitmasks of a batch mixing unconstrained rows, a min_tokens row and grammars that
    end early, filled by `fill_threads` threads, as the same tokens are sampled."""
    from grammar_steps import EOS, REGEX

    from radix_runtime.messages import SamplingParams
    from radix_runtime.worker.sampler import Sampler

    tokenizer, cache = grammar_cache()
    cache.submit("regex", REGEX)
    cache.submit("regex", "[0-9]{2}")
    sampler = Sampler(
        tokenizer.vocab_size, CPU, seed=0, eos_token_ids=[EOS], grammars=cache,
        fill_threads=fill_threads,
    )  # fmt: skip
    params = [
        SamplingParams(temperature=0.0, regex=REGEX),
        SamplingParams(temperature=0.0),  # unconstrained: no mask row
        SamplingParams(temperature=0.0, regex="[0-9]{2}"),  # ends after 2 tokens + EOS
        SamplingParams(temperature=0.0, regex=REGEX, min_tokens=6),
        SamplingParams(temperature=0.0, min_tokens=3),
    ]
    slots = list(range(len(params)))
    for slot, p in zip(slots, params):
        sampler.reset_slot(slot, p)
    gen = torch.Generator().manual_seed(1)
    masks, masked = [], []
    for step in range(steps):
        logits = torch.randn(len(slots), tokenizer.vocab_size, generator=gen) * 4
        found = sampler.grammar_masks(slots)
        assert found is not None
        bitmask, rows = found
        masks.append(bitmask.clone())
        masked.append(rows)
        assert 1 not in rows and 4 not in rows  # only the grammars' rows are masked
        if step == 0:  # an unconstrained row allows every token
            assert len(bits(bitmask[1])) == 32 * bitmask.shape[1]
        sampler.apply_constraints(logits, slots)  # the same masks (no token pending now)
        ids = logits.argmax(dim=-1)
        sampler.note_sampled(slots, step, ids, None)
    assert 2 in masked[0] and 2 not in masked[-1]  # that grammar ended on the way
    return masks


def test_batch_fill_on_threads_equals_one_by_one():
    """xgrammar's BatchGrammarMatcher on threads fills the same masks as the matchers one by one
    (grammars that finish, unconstrained and min_tokens rows in the batch)."""
    one_by_one = _masks_over_steps(0)
    for threads in (2, 3):  # 3: more threads than the batch has grammar rows
        threaded = _masks_over_steps(threads)
        assert len(one_by_one) == len(threaded)
        for a, b in zip(one_by_one, threaded):
            assert torch.equal(a, b)


def test_jump_forward_retokenizes_the_boundary():
    """The sampled token and the forced string are tokenized together: `{` then the forced
    `"customer_full_name": "` become the tokenizer's own `{"`, `customer`, ... (the sampled `{`
    replaced), every token allowed by the grammar, the matcher where the text leaves it."""
    import json

    import xgrammar as xgr

    from radix_runtime.grammar.matcher import SlotGrammar

    tokenizer, cache = grammar_cache()
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"customer_full_name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["customer_full_name", "age"],
        }
    )
    cache.submit("json_schema", schema)
    compiled = cache.get("json_schema", schema)
    encode = cache.encode
    (brace,) = encode("{")

    def after_brace() -> SlotGrammar:
        g = SlotGrammar(compiled)
        g.accept(brace)
        return g

    forced_text = '"customer_full_name": "'
    # on its own (no token_bytes): the sampled `{` stays, the string is tokenized alone
    replaced, alone = after_brace().jump_forward(encode)
    assert replaced is None and alone == encode(forced_text)
    g = after_brace()
    replaced, forced = g.jump_forward(encode, cache.token_bytes)
    assert replaced is not None and replaced != brace
    assert [replaced, *forced] == encode("{" + forced_text)  # the tokenizer's own tokens
    assert tokenizer.decode([replaced, *forced]) == "{" + forced_text
    # the matcher is where the text leaves it: the string's value comes next, then `", "age"`
    reference = xgr.GrammarMatcher(compiled)
    for t in encode("{" + forced_text):
        assert reference.accept_token(t)
    for t in encode('Bob"'):
        g.accept(t)
        assert g.error is None and reference.accept_token(t)
    assert g.matcher.find_jump_forward_string() == reference.find_jump_forward_string()
    replaced, forced = g.jump_forward(encode, cache.token_bytes)
    assert replaced is not None  # `"` + `, "age":` -> `",`, ` "`, `age`, `":`
    assert tokenizer.decode([replaced, *forced]) == '", "age":'
    assert [replaced, *forced] == encode('", "age":')


# ---------------------------------------------------------------------------------------------
# the scheduler's side: a request waits for its grammar without holding anything up


def _scheduler():
    from radix_runtime import messages as m
    from radix_runtime.config import ServerArgs
    from radix_runtime.scheduler.scheduler import Scheduler

    ready = m.WorkerReady(
        num_pages=256, page_size=1, context_length=512, vocab_size=1000, eos_token_ids=[2],
        device="cpu", dtype="float32", attention_backend="torch",
    )  # fmt: skip
    return Scheduler(ServerArgs(max_running_requests=4), ready)


def _req(rid: str, **sampling):
    from radix_runtime import messages as m

    return m.GenerateReq(
        rid=rid, input_ids=m.pack_ids([5, 6, 7]), sampling=m.SamplingParams(**sampling)
    )


def test_scheduler_runs_others_while_a_grammar_compiles():
    from radix_runtime import messages as m

    sched = _scheduler()
    sched.add_request(_req("slow", regex="a+"))
    sched.add_request(_req("shared", regex="a+"))  # joins the compile in flight
    sched.add_request(_req("free"))
    (compile_msg,) = sched.take_worker_messages()
    assert (compile_msg.kind, compile_msg.text) == ("regex", "a+")
    batch, _ = sched.schedule()
    assert [r.slot for r in batch.reqs] == [sched.reqs["free"].slot]  # not held up
    sched.grammar_compiled(m.GrammarCompiled(kind="regex", text="a+", compile_s=0.5))
    assert {r.rid for r in sched.waiting} == {"slow", "shared"}
    sched.add_request(_req("later", regex="a+"))  # compiled already: straight to the queue
    assert sched.take_worker_messages() == [] and sched.waiting[-1].rid == "later"
    stats = sched.grammar_stats()
    assert (stats.requests, stats.cache_hits, stats.compiles) == (3, 2, 1)
    assert stats.compile_p50_s == 0.5


def test_scheduler_fails_requests_of_an_invalid_grammar_and_aborts_waiting_ones():
    from radix_runtime import messages as m

    sched = _scheduler()
    for rid in ("a", "b", "c"):
        sched.add_request(_req(rid, ebnf="root ::= x"))
    sched.abort("c")  # while its grammar compiles
    outs = {o.rid: o for o in sched.take_outputs()}
    assert outs["c"].finish_reason == "abort"
    sched.grammar_compiled(
        m.GrammarCompiled(kind="ebnf", text="root ::= x", error="invalid EBNF grammar: x")
    )
    outs = {o.rid: o for o in sched.take_outputs()}
    assert set(outs) == {"a", "b"}
    assert all(
        o.error_code == "invalid_grammar" and o.finish_reason == "error" for o in outs.values()
    )
    assert not sched.has_work() and not sched.grammar_waiting and not sched.reqs
    sched.check_integrity()


# ---------------------------------------------------------------------------------------------
# the logits columns past the tokenizer's ids (a padded vocabulary), and the fill threads


def test_padded_vocabulary_is_masked_by_the_sampler():
    check_padded_vocabulary(CPU)


def test_stop_ids_outside_the_tokenizer_fall_back_to_its_eos():
    """Dummy weights with a stand-in tokenizer: the model's EOS ids are past the tokenizer's
    ids, so a grammar stops on the tokenizer's own EOS."""
    from radix_runtime.grammar.compiler import GrammarCache

    tokenizer, _ = grammar_cache()
    n = tokenizer.vocab_size
    cache = GrammarCache(lambda: tokenizer, 128256, [128001, 128009])
    assert cache.info.vocab_size == n
    assert sorted(cache.info.stop_token_ids) == sorted(t for t in tokenizer.eos_token_ids if t < n)
    assert cache.info.stop_token_ids


def test_fill_threads_default_resolves_per_device(monkeypatch):
    """--grammar-fill-threads defaults to None, resolved by the worker: half the cores it may
    use (split between the tensor-parallel ranks on the host), at most 8, on CUDA; 0 on the CPU
    (torch's threads use the cores there); an explicit value wins."""
    from types import SimpleNamespace

    from radix_runtime.config import (
        ServerArgs,
        auto_grammar_fill_threads,
        parse_server_args,
    )
    from radix_runtime.worker.model_runner import ModelRunner

    assert ServerArgs().grammar_fill_threads is None
    assert parse_server_args([]).grammar_fill_threads is None
    assert parse_server_args(["--grammar-fill-threads", "3"]).grammar_fill_threads == 3
    with pytest.raises(ValueError):
        ServerArgs(grammar_fill_threads=-1).validate()
    assert [auto_grammar_fill_threads("cuda", c) for c in (1, 2, 6, 16, 64)] == [0, 1, 3, 8, 8]
    assert auto_grammar_fill_threads("cpu", 64) == 0

    def resolved(device: str, cores: int, **args) -> int:
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
        fake = SimpleNamespace(args=ServerArgs(**args), device=torch.device(device))
        return ModelRunner._fill_threads(fake)

    assert resolved("cuda", 16) == 8  # the H200 host's 16 cores
    assert resolved("cuda", 6) == 3
    assert resolved("cuda", 16, tp=4) == 2  # 4 ranks share the host's cores
    assert resolved("cpu", 16) == 0
    assert resolved("cuda", 16, grammar_fill_threads=0) == 0
    assert resolved("cpu", 16, grammar_fill_threads=2) == 2


def test_exported_tokenizer_is_the_same_vocabulary(tmp_path):
    """bench/export_tokenizer.py: the folder the H200 runs carry loads as the same tokens."""
    from bench.export_tokenizer import export
    from radix_runtime.tokenizer import load_tokenizer

    tokenizer, _ = grammar_cache()
    export("default", str(tmp_path))
    copy = load_tokenizer(str(tmp_path))
    assert copy.vocab_size == tokenizer.vocab_size
    assert sorted(copy.eos_token_ids) == sorted(tokenizer.eos_token_ids)
    for tid in range(0, tokenizer.vocab_size, 97):
        assert copy.token_bytes(tid) == tokenizer.token_bytes(tid)
        assert copy.is_special(tid) == tokenizer.is_special(tid)
    text = 'Hello {"a": [1, 2.5]} wörld <|im_end|>'
    assert copy.encode(text) == tokenizer.encode(text)
