"""The sampler: greedy, filters, seeds, penalties, logit bias, and the logprobs it reports."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radix_runtime.messages import SamplingParams
from radix_runtime.worker.sampler import Sampler

V = 32


def make_sampler(params: list[SamplingParams], seed: int = 0) -> Sampler:
    s = Sampler(V, torch.device("cpu"), seed)
    for slot, p in enumerate(params):
        s.reset_slot(slot, p)
    return s


def draw(s: Sampler, logits: torch.Tensor, slots: list[int] | None = None, **kw) -> list[int]:
    slots = list(range(len(logits))) if slots is None else slots
    n = len(slots)
    return s.sample(
        logits, slots, kw.get("return_logprob", [False] * n), kw.get("top", [0] * n)
    ).next_ids


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = random_logits(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=1.5)] * 2
    assert draw(make_sampler(params), logits) == logits.argmax(-1).tolist()


def test_tiny_top_p_picks_the_argmax():
    logits = random_logits(8)
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 8
    assert draw(make_sampler(params), logits) == logits.argmax(-1).tolist()


def test_seed_gives_the_same_tokens_whatever_the_batch():
    logits = random_logits(1).repeat(20, 1)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = make_sampler([seeded])
    tokens_alone = [draw(alone, logits[:1])[0] for _ in range(20)]
    # same seed, now sharing every step with an unseeded neighbour
    crowded = make_sampler([SamplingParams(temperature=1.0), seeded], seed=99)
    tokens_crowded = [draw(crowded, logits[:2], [0, 1])[1] for _ in range(20)]
    assert tokens_alone == tokens_crowded
    assert len(set(tokens_alone)) > 1  # it really samples
    other = make_sampler([SamplingParams(temperature=1.0, seed=4321)])
    assert [draw(other, logits[:1])[0] for _ in range(20)] != tokens_alone


def test_temperature_sampling_follows_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-1e9] * (V - 3)]).repeat(4000, 1)
    s = make_sampler([SamplingParams(temperature=2.0)] * 4000)
    counts = np.bincount(draw(s, logits), minlength=V)[:3] / 4000
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 2.0, -1).numpy()
    assert np.abs(counts - want).max() < 0.03


def allowed_tokens(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """A direct (slow) statement of top_k, then top_p on the renormalised top-k mass, then min_p."""
    probs = torch.softmax(row / p.temperature, -1)
    order = probs.argsort(descending=True).tolist()
    k = p.top_k if p.top_k > 0 else V
    kept = order[:k]
    mass = probs[kept].sum()
    nucleus, before = [], 0.0
    for t in kept:
        if before > p.top_p:
            break
        nucleus.append(t)
        before += float(probs[t] / mass)
    top = float(probs.max())
    return {t for t in nucleus if float(probs[t]) >= p.min_p * top}


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.floats(0.3, 2.0),
    top_k=st.sampled_from([-1, 2, 5]),
    top_p=st.floats(0.05, 1.0),
    min_p=st.sampled_from([0.0, 0.1, 0.5]),
)
def test_samples_stay_inside_top_k_top_p_min_p(seed, temperature, top_k, top_p, min_p):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    row = random_logits(1, seed)[0]
    allowed = allowed_tokens(row, p)
    s = make_sampler([p] * 64, seed=seed)
    assert set(draw(s, row.repeat(64, 1))) <= allowed


def test_min_p_drops_tokens_far_below_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-12] * (V - 4)])).repeat(500, 1)
    s = make_sampler([SamplingParams(temperature=1.0, min_p=0.5)] * 500)
    assert set(draw(s, logits)) == {0, 1}


def test_logit_bias_steers_the_pick():
    logits = random_logits(2)
    top = int(logits[0].argmax())
    target = (top + 1) % V
    s = make_sampler(
        [
            SamplingParams(temperature=0.0, logit_bias={target: 100.0}),
            SamplingParams(temperature=0.0, logit_bias={top: -100.0}),
        ]
    )
    ids = draw(s, torch.stack([logits[0], logits[0]]))
    assert ids[0] == target
    assert ids[1] == int(logits[0].topk(2).indices[1])


def _two_close_tokens() -> torch.Tensor:
    logits = torch.full((1, V), -5.0)
    logits[0, 7], logits[0, 9] = 3.0, 2.9
    return logits


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
    ],
)
def test_penalties_push_away_from_repeated_output(params):
    s = make_sampler([params])
    logits = _two_close_tokens()
    assert draw(s, logits) == [7]
    assert draw(s, logits) == [9]  # 7 was output once: penalised below 9


def test_frequency_penalty_grows_with_the_count_presence_does_not():
    logits = torch.full((1, V), -5.0)
    logits[0, 7], logits[0, 9] = 3.0, 2.0
    freq = make_sampler([SamplingParams(temperature=0.0, frequency_penalty=0.4)])
    assert [draw(freq, logits)[0] for _ in range(4)] == [7, 7, 7, 9]  # 3.0 - 0.4 * 3 < 2.0
    presence = make_sampler([SamplingParams(temperature=0.0, presence_penalty=0.4)])
    assert [draw(presence, logits)[0] for _ in range(4)] == [7, 7, 7, 7]


def test_repetition_penalty_counts_prompt_tokens_and_handles_negative_logits():
    logits = torch.full((1, V), -5.0)
    logits[0, 3], logits[0, 4] = -1.0, -1.1
    s = make_sampler([SamplingParams(temperature=0.0, repetition_penalty=1.5)])
    s.observe_fed(0, torch.tensor([3, 11]))  # a prompt that contains token 3
    assert draw(s, logits) == [4]  # -1.0 * 1.5 < -1.1


def test_penalties_are_per_slot_and_reset_with_the_slot():
    logits = _two_close_tokens().repeat(2, 1)
    p = SamplingParams(temperature=0.0, presence_penalty=0.5)
    s = make_sampler([p, SamplingParams(temperature=0.0)])
    assert draw(s, logits) == [7, 7]
    assert draw(s, logits) == [9, 7]  # only slot 0 is penalised
    s.reset_slot(0, p)
    assert draw(s, logits[:1], [0]) == [7]


def test_logprobs_are_the_raw_log_softmax():
    logits = random_logits(3)
    params = [
        SamplingParams(temperature=0.7, presence_penalty=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=3),
    ]
    s = make_sampler(params)
    out = s.sample(logits, [0, 1, 2], [True, True, False], [4, 0, 2])
    ref = torch.log_softmax(logits, -1)
    for i in range(2):
        assert out.logprobs[i] == pytest.approx(float(ref[i, out.next_ids[i]]), abs=1e-6)
    assert out.logprobs[2] == 0.0  # not asked for
    for i, k in [(0, 4), (2, 2)]:
        vals, idx = ref[i].topk(k)
        np.testing.assert_array_equal(out.top_ids[i], idx.numpy())
        np.testing.assert_allclose(out.top_logprobs[i], vals.numpy(), atol=1e-6)
    assert len(out.top_ids[1]) == 0
