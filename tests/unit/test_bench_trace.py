"""The pure parts of the benchmarks: trace generation, the optimal hit rate, statistics."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds bench/

from bench import common, serving  # noqa: E402
from bench.multi_turn_chat import (  # noqa: E402
    ChatTrace,
    Turn,
    build_messages,
    build_prompt,
    make_trace,
    max_prompt_tokens,
    section,
)

optimal = common.optimal_cached_tokens

# ---------------------------------------------------------------------------------------------
# optimal_cached_tokens on hand-made traces


def test_first_request_hits_nothing():
    assert optimal([([1, 2, 3], [4])]) == [0]


def test_longest_shared_prefix_with_an_earlier_prompt():
    assert optimal([([1, 2, 3, 4], []), ([1, 2, 3, 9, 9], [])]) == [0, 3]


def test_the_last_prompt_token_is_never_a_hit():
    # the same prompt twice: everything but its last token
    assert optimal([([1, 2, 3, 4], [5]), ([1, 2, 3, 4], [6])]) == [0, 3]
    # a prompt that is a prefix of an earlier one
    assert optimal([([1, 2, 3, 4], []), ([1, 2], [])]) == [0, 1]
    # a one-token prompt can never hit
    assert optimal([([7], []), ([7], [])]) == [0, 0]


def test_the_answer_is_cached_but_its_last_token():
    # the next round extends prompt + answer; the answer's last token was never computed
    assert optimal([([1, 2], [3, 4, 5]), ([1, 2, 3, 4, 5, 6], [])]) == [0, 4]
    # a partial match into the answer counts
    assert optimal([([1, 2], [3, 4, 5]), ([1, 2, 3, 9], [])]) == [0, 3]
    # a one-token answer adds nothing
    assert optimal([([1, 2, 3], [4]), ([1, 2, 3, 4, 5], [])]) == [0, 3]


def test_best_of_all_earlier_requests():
    reqs = [
        ([1, 2, 3, 4, 5], []),
        ([1, 2, 8, 8, 8], []),
        ([1, 2, 3, 4, 9, 9], []),  # 4 from the first, 2 from the second
        ([1, 2, 8, 8, 7], []),  # 4 from the second
    ]
    assert optimal(reqs) == [0, 2, 4, 4]


def test_issue_order_matters():
    a, b = ([1, 2, 3, 4], [5, 6]), ([1, 2, 3, 4, 5, 6, 7], [8])
    assert optimal([a, b]) == [0, 5]
    assert optimal([b, a]) == [0, 3]


def test_page_alignment_rounds_down_to_whole_pages():
    reqs = [([1, 2, 3, 4, 5, 6, 7], []), ([1, 2, 3, 4, 5, 0, 0, 0], [])]
    assert optimal(reqs, page_size=1) == [0, 5]
    assert optimal(reqs, page_size=2) == [0, 4]
    assert optimal(reqs, page_size=4) == [0, 4]
    assert optimal(reqs, page_size=8) == [0, 0]
    # the last-token rule applies before rounding: 4 shared tokens of a 4-token prompt -> 3 -> 2
    assert optimal([([1, 2, 3, 4], []), ([1, 2, 3, 4], [])], page_size=2) == [0, 2]


def test_no_sharing_at_all():
    reqs = [([i, i + 100, i + 200], [i + 300]) for i in range(5)]
    assert optimal(reqs) == [0] * 5


# ---------------------------------------------------------------------------------------------
# the multi-turn trace


def hand_trace() -> ChatTrace:
    return ChatTrace(
        system=(1, 2, 3),
        contexts=((10,), (20,)),
        user_turns=(((11,), (12,)), ((21,), (22,))),
    )


def test_build_prompt_grows_by_answer_and_user_turn():
    t = hand_trace()
    assert build_prompt(t, 0, []) == [1, 2, 3, 10, 11]
    assert build_prompt(t, 1, []) == [1, 2, 3, 20, 21]
    assert build_prompt(t, 0, [[50, 51]]) == [1, 2, 3, 10, 11, 50, 51, 12]
    assert build_prompt(t, 1, [[60]]) == [1, 2, 3, 20, 21, 60, 22]


def test_optimal_hit_rate_of_an_interleaved_hand_trace():
    t = hand_trace()
    a = {(0, 0): [50, 51], (1, 0): [60, 61], (0, 1): [52], (1, 1): [62]}
    order = [(0, 0), (1, 0), (0, 1), (1, 1)]
    reqs = []
    for c, r in order:
        prompt = build_prompt(t, c, [a[(c, k)] for k in range(r)])
        reqs.append((prompt, a[(c, r)]))
    # round 0: the second client shares the system prompt; round 1: the previous prompt and
    # answer but its last token (never computed), so the new turn and one answer token miss
    assert optimal(reqs) == [0, 3, 6, 6]
    prompt_tokens = sum(len(p) for p, _ in reqs)
    assert prompt_tokens == 5 + 5 + 8 + 8


def test_make_trace_is_deterministic_and_in_range():
    args = dict(clients=3, rounds=4, system_tokens=16, context_tokens=8, user_tokens=4)
    t1 = make_trace(**args, seed=7, token_range=(100, 200))
    t2 = make_trace(**args, seed=7, token_range=(100, 200))
    t3 = make_trace(**args, seed=8, token_range=(100, 200))
    assert t1 == t2
    assert t1 != t3
    assert (t1.clients, t1.rounds) == (3, 4)
    assert len(t1.system) == 16
    assert all(len(c) == 8 for c in t1.contexts)
    assert all(len(u) == 4 for turns in t1.user_turns for u in turns)
    every = [*t1.system, *(x for c in t1.contexts for x in c)]
    every += [x for turns in t1.user_turns for u in turns for x in u]
    assert all(100 <= x < 200 for x in every)


def test_prompts_of_a_client_extend_each_other():
    t = make_trace(2, 3, 8, 4, 2, seed=0, token_range=(1000, 2000))
    answers = [[5, 6, 7], [8, 9, 10]]
    prompts = [build_prompt(t, 1, answers[:r]) for r in range(3)]
    for r in range(2):
        assert prompts[r + 1][: len(prompts[r])] == prompts[r]
        assert prompts[r + 1][len(prompts[r]) : len(prompts[r]) + 3] == answers[r]
    assert len(prompts[-1]) == max_prompt_tokens(3, 8, 4, 2, 3)


def test_optimal_of_a_generated_trace_matches_the_closed_form():
    clients, rounds, sys_t, ctx_t, user_t, ans_t = 4, 3, 32, 16, 8, 5
    t = make_trace(clients, rounds, sys_t, ctx_t, user_t, seed=1, token_range=(1000, 40000))
    # distinct first context tokens, so clients share exactly the system prompt
    assert len({c[0] for c in t.contexts}) == clients
    answers = {(c, r): [40000 + 10 * c + r] * ans_t for c in range(clients) for r in range(rounds)}
    reqs = []
    for r in range(rounds):  # round-robin issue order
        for c in range(clients):
            prompt = build_prompt(t, c, [answers[(c, k)] for k in range(r)])
            reqs.append((prompt, answers[(c, r)]))
    got = optimal(reqs)
    expected = []
    for r in range(rounds):
        for c in range(clients):
            if r == 0:
                expected.append(0 if c == 0 else sys_t)
            else:  # the whole previous prompt + answer but the answer's last token
                expected.append(sys_t + ctx_t + r * user_t + r * ans_t - 1)
    assert got == expected


def test_build_messages_alternates_roles():
    t = hand_trace()
    msgs = build_messages(t, 0, ["first answer"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[2]["content"] == "first answer"
    assert build_messages(t, 0, [])[:2] == msgs[:2]


def test_section_per_round_arrays():
    t = hand_trace()
    turns = []
    for i, (c, r) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
        res = common.RequestResult(
            prompt_tokens=5 if r == 0 else 8,
            cached_tokens=[0, 3, 7, 6][i],
            output_ids=[1, 2],
            output_tokens=2,
            ttft_s=0.1 * (i + 1),
            itls_s=[0.01],
            end_s=1.0,
        )
        turns.append(Turn(c, r, i, build_prompt(t, c, [[1, 2]] * r), [1, 2], res))
    sec = section(turns, 2.0, 2, [0, 3, 7, 7])
    assert sec["hit_rate"] == pytest.approx(16 / 26)
    assert sec["optimal_hit_rate"] == pytest.approx(17 / 26)
    assert sec["per_round"]["hit_rate"] == pytest.approx([3 / 10, 13 / 16])
    assert sec["per_round"]["optimal_hit_rate"] == pytest.approx([3 / 10, 14 / 16])
    assert sec["per_round"]["ttft_p50_s"] == pytest.approx([0.15, 0.35])
    assert sec["output_tok_s"] == pytest.approx(8 / 2.0)
    assert sec["req_s"] == pytest.approx(4 / 2.0)


# ---------------------------------------------------------------------------------------------
# serving datasets


def test_shared_prefix_dataset_groups_share_exactly_the_system_prompt():
    reqs = serving.shared_prefix_requests(3, 4, 20, 6, 5, seed=0, token_range=(1000, 40000))
    assert len(reqs) == 12
    assert all(len(r.prompt) == 26 and r.output_len == 5 for r in reqs)
    assert len({r.prompt[:20] for r in reqs}) == 3
    assert reqs == serving.shared_prefix_requests(3, 4, 20, 6, 5, 0, (1000, 40000))
    hits = optimal([(r.prompt, []) for r in reqs])
    # every prompt but the first of each group shares the system prompt (and maybe a bit more)
    assert sum(h >= 20 for h in hits) == 3 * 3


def test_random_dataset_lengths():
    reqs = serving.random_requests(50, 40, 10, 0.5, seed=0, token_range=(1000, 2000))
    assert len(reqs) == 50
    assert all(20 <= len(r.prompt) <= 40 and 5 <= r.output_len <= 10 for r in reqs)
    assert all(1000 <= x < 2000 for r in reqs for x in r.prompt)
    fixed = serving.random_requests(5, 40, 10, 1.0, seed=0, token_range=(1000, 2000))
    assert all(len(r.prompt) == 40 and r.output_len == 10 for r in fixed)


def test_parse_rates():
    assert serving.parse_rates("1,2.5,inf") == [1.0, 2.5, math.inf]


# ---------------------------------------------------------------------------------------------
# statistics and helpers


def test_percentile_and_summary():
    assert common.percentile([], 50) is None
    assert common.percentile([1.0, 2.0, 3.0], 50) == 2.0
    ok = common.RequestResult(prompt_tokens=10, cached_tokens=4, output_tokens=3, ttft_s=0.5)
    bad = common.RequestResult(prompt_tokens=10, error="boom")
    s = common.summarize([ok, bad], 2.0)
    assert (s["requests"], s["errors"], s["hit_rate"], s["output_tok_s"]) == (2, 1, 0.4, 1.5)
    assert s["itl_p50_s"] is None


def test_safe_token_range_avoids_the_edges():
    lo, hi = common.safe_token_range(49152)
    assert 0 < lo < hi < 49152
    lo, hi = common.safe_token_range(128256)
    assert hi <= 128000  # Llama-3's special tokens
    assert common.safe_token_range(10) == (0, 10)  # too small to trim: everything


def test_jsonable_drops_non_finite_floats():
    assert common.jsonable({"a": math.inf, "b": [math.nan, 1.0], "c": (2,)}) == {
        "a": None,
        "b": [None, 1.0],
        "c": [2],
    }


def test_client_runs_on_uvloop_and_the_json_says_so():
    """The benchmark clients run on uvloop (a dependency, as the server's loop), and the JSON's
    host section names the loop and the HTTP parser a launched server gets."""
    import asyncio

    import httptools
    import uvloop

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert common.run_async(loop_module()).startswith("uvloop")
    host = common.host_info()
    assert host["uvloop"] == uvloop.__version__
    assert host["httptools"] == httptools.__version__
