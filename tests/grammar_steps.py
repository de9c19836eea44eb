"""Sampling under grammar masks, shared by tests/unit/test_grammar.py (CPU) and
tests/gpu/test_grammar_gpu.py (CUDA): random logits that favour forbidden tokens, every sampler
setting, and the tokens checked against the grammar."""

from __future__ import annotations

import functools
import re

import torch

from radix_runtime.messages import SamplingParams
from radix_runtime.worker.sampler import Sampler

REGEX = r"\[([0-9]{1,4}, ){2,6}[0-9]{1,4}\]"
EOS = 2


@functools.cache
def grammar_cache():
    from radix_runtime.grammar.compiler import GrammarCache
    from radix_runtime.model_source import ModelNotFound
    from radix_runtime.tokenizer import byte_tokenizer, load_tokenizer

    try:
        tokenizer = load_tokenizer("default")
    except ModelNotFound:  # a machine without the embedded model (the H200)
        tokenizer = byte_tokenizer()
    cache = GrammarCache(lambda: tokenizer, tokenizer.vocab_size, [EOS])
    return tokenizer, cache


def is_prefix(text: str) -> bool:
    """Whether `text` can start an output that REGEX matches (a cut-off output)."""
    import xgrammar as xgr

    _, cache = grammar_cache()
    cache.submit("regex", REGEX)
    return xgr.GrammarMatcher(cache.get("regex", REGEX)).accept_string(text)


def settings(tokenizer) -> list[SamplingParams]:
    """Every sampler path, each constrained by REGEX."""
    base = dict(regex=REGEX, max_new_tokens=64)
    never = tokenizer.encode("x", add_special_tokens=False)[0]  # REGEX has no letters
    return [
        SamplingParams(temperature=0.0, **base),
        SamplingParams(temperature=1.3, seed=7, **base),
        SamplingParams(temperature=1.0, top_p=0.6, top_k=8, min_p=0.01, **base),
        SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=1.0, **base),
        # a +100 bias on a token the grammar never allows: the mask still wins
        SamplingParams(temperature=0.8, logit_bias={0: 50.0, never: 100.0}, **base),
    ]


def run_constrained(device: torch.device, steps: int = 24) -> tuple[list[str], list[float]]:
    """Sample `steps` tokens per setting; returns each slot's text and every sampled logprob."""
    tokenizer, cache = grammar_cache()
    params = settings(tokenizer)
    cache.submit("regex", REGEX)
    sampler = Sampler(tokenizer.vocab_size, device, seed=0, eos_token_ids=[EOS], grammars=cache)
    slots = list(range(len(params)))
    for slot, p in zip(slots, params):
        sampler.reset_slot(slot, p)
    gen = torch.Generator(device=device).manual_seed(0)
    outputs: list[list[int]] = [[] for _ in slots]
    live = list(slots)
    logprobs: list[float] = []
    for step in range(steps):
        if not live:
            break
        logits = torch.randn(len(live), tokenizer.vocab_size, generator=gen, device=device) * 4
        logits[:, EOS] += 3.0  # the model wants to stop early: only the grammar's end allows it
        out = sampler.sample_on_device(logits, live, [True] * len(live), [2] * len(live))
        host = out.next_ids.cpu()
        res = out.to_host([t.cpu() for t in out.tensors()])
        logprobs += res.logprobs
        sampler.note_sampled(live, step, host, None)
        for i, slot in enumerate(list(live)):
            outputs[slot].append(int(host[i]))
            done, error, _, _ = sampler.grammar_status(slot, step)
            assert error is None, error
            if done:
                live.remove(slot)
    texts = []
    for ids in outputs:
        text_ids = ids[:-1] if ids and ids[-1] == EOS else ids
        texts.append(tokenizer.decode(text_ids))
    return texts, logprobs


def check_constrained(device: torch.device) -> None:
    texts, logprobs = run_constrained(device)
    for text in texts:
        assert is_prefix(text), text
    assert any(re.fullmatch(REGEX, t) for t in texts), texts
    assert all(lp > float("-inf") for lp in logprobs)  # sampled tokens are allowed tokens


def check_min_tokens(device: torch.device) -> None:
    """EOS (and a stop token id) masked until min_tokens outputs; then the favourite again."""
    tokenizer, cache = grammar_cache()
    sampler = Sampler(tokenizer.vocab_size, device, seed=0, eos_token_ids=[EOS], grammars=cache)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    sampler.reset_slot(0, params)
    picks = []
    for step in range(5):
        logits = torch.zeros(1, tokenizer.vocab_size, device=device)
        logits[0, EOS], logits[0, 5], logits[0, 100] = 10.0, 9.0, 1.0
        ids = sampler.sample_on_device(logits, [0], [False], [0]).next_ids.cpu()
        sampler.note_sampled([0], step, ids, None)
        picks.append(int(ids[0]))
    assert picks == [100, 100, 100, EOS, EOS]


def bits(row: torch.Tensor) -> set[int]:
    """The token ids an int32 bitmask row allows."""
    return {w * 32 + b for w in range(len(row)) for b in range(32) if int(row[w]) >> b & 1}


def check_padded_vocabulary(device: torch.device) -> None:
    """A model with more logits columns than its tokenizer has ids: xgrammar's vocabulary is
    the tokenizer's (no padding as special tokens, which made every accept scan them), the masks
    over it equal those of a padded vocabulary, and the sampler never lets a constrained row
    pick a column past it (an unconstrained row still may)."""
    import xgrammar as xgr

    from radix_runtime.grammar.compiler import GrammarCache

    tokenizer, _ = grammar_cache()
    n, vocab = tokenizer.vocab_size, tokenizer.vocab_size + 77
    cache = GrammarCache(lambda: tokenizer, vocab, [2])
    assert cache.info.vocab_size == n and cache.info.stop_token_ids == [2]
    cache.submit("regex", REGEX)
    padded_info = xgr.TokenizerInfo(
        list(cache.info.decoded_vocab) + [b""] * (vocab - n),
        vocab_type=xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[2],
    )  # fmt: skip
    padded = xgr.GrammarMatcher(xgr.GrammarCompiler(padded_info).compile_regex(REGEX))
    sampler = Sampler(vocab, device, seed=0, eos_token_ids=[2], grammars=cache, fill_threads=2)
    sampler.reset_slot(0, SamplingParams(temperature=0.0, regex=REGEX))
    sampler.reset_slot(1, SamplingParams(temperature=0.0))
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        bitmask, rows = sampler.grammar_masks([0, 1])
        assert rows == [0] and bitmask.shape[1] == (n + 31) // 32
        reference = xgr.allocate_token_bitmask(1, vocab)
        padded.fill_next_token_bitmask(reference)
        assert bits(reference[0]) == {t for t in bits(bitmask[0]) if t < n}
        logits = torch.randn(2, vocab, generator=gen).to(device)
        logits[:, n:] = 100.0  # the columns without a token win unless masked
        sampler.apply_constraints(logits, [0, 1])
        ids = logits.argmax(dim=-1)
        assert int(ids[0]) < n and int(ids[1]) >= n
        sampler.note_sampled([0, 1], step, ids.cpu(), None)
        assert padded.accept_token(int(ids[0]))
