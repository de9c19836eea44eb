"""Streaming text: UTF-8 safe incremental detokenization and stop strings."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radix_runtime import model_source
from radix_runtime.model_source import ModelNotFound
from radix_runtime.tokenizer import (
    IncrementalDetokenizer,
    StopMatcher,
    Tokenizer,
    byte_tokenizer,
    load_tokenizer,
)

REPLACEMENT = "\ufffd"
# ASCII, spaces, accents, CJK, emoji (4 bytes), a skin tone, a zero-width joiner, a combining mark
CHARS = list("abc XYZ019.,'\n\t") + [
    "  ",
    "é",
    "ß",
    "中",
    "日",
    "😀",
    "🎉",
    "🏽",
    "\u200d",
    "\u0301",
    "ü",
]


@pytest.fixture(scope="module")
def default_tok() -> Tokenizer:
    try:
        return load_tokenizer(model_source.default_gguf_path())
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A tiny sentencepiece BPE with byte fallback: CJK and emoji are not in its vocabulary, so
    they come out as <0xNN> byte pieces."""
    sentencepiece = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("spm")
    rng = random.Random(0)
    # fmt: off
    words = [
        "hello", "world", "the", "quick", "brown", "fox", "café", "über", "a", "is", "of", "12",
        "code",
    ]
    # fmt: on
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    (folder / "corpus.txt").write_text("\n".join(lines), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    return load_tokenizer(str(folder))


def _stream(tok: Tokenizer, ids: list[int], chunks: list[int], **kw) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, **kw)
    deltas, pos, i = [], 0, 0
    while pos < len(ids):
        n = chunks[i % len(chunks)] if chunks else 1
        deltas.append(detok.add(ids[pos : pos + n]))
        pos, i = pos + n, i + 1
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas, detok.text


texts = st.lists(st.sampled_from(CHARS), max_size=40).map("".join)
chunkings = st.lists(st.integers(min_value=1, max_value=4), max_size=5)


@pytest.mark.parametrize("which", ["default", "spm", "bytes"])
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, chunks=chunkings)
def test_stream_equals_full_decode(request, which: str, text: str, chunks: list[int]) -> None:
    tok = {"default": "default_tok", "spm": "spm_tok", "bytes": None}[which]
    tok = request.getfixturevalue(tok) if tok else byte_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    deltas, joined = _stream(tok, ids, chunks)
    assert joined == tok.decode(ids)
    assert not any(REPLACEMENT in d for d in deltas), deltas


def test_emoji_over_several_tokens_waits_for_the_last(default_tok: Tokenizer) -> None:
    ids = default_tok.encode("ok 😀", add_special_tokens=False)
    assert len(ids) >= 3  # "ok", then the emoji's bytes over two or more tokens
    detok = IncrementalDetokenizer(default_tok)
    out = [detok.add([i]) for i in ids]
    assert out[0] == "ok" and all(d == "" for d in out[1:-1]) and out[-1] == " 😀"


def test_incomplete_character_at_the_end_is_flushed_as_replacement() -> None:
    tok = byte_tokenizer()
    ids = tok.encode("a😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) == "a"
    assert detok.add(ids[1:3]) == ""  # two of the emoji's four bytes
    assert detok.flush() == REPLACEMENT  # generation ended mid-character
    assert detok.text == tok.decode(ids[:3])


def test_sentencepiece_spaces(spm_tok: Tokenizer) -> None:
    ids = spm_tok.encode("hello world of code", add_special_tokens=False)
    assert spm_tok.id_to_piece(ids[0]).startswith("\u2581")
    deltas, joined = _stream(spm_tok, ids, [1])
    assert joined == "hello world of code"  # the first ▁ is dropped, the inner ones are spaces
    assert deltas[0] == "hello" and " world" in deltas


def test_prompt_context_keeps_the_first_space(spm_tok: Tokenizer) -> None:
    prompt = spm_tok.encode("the quick brown")  # with BOS
    output = spm_tok.encode(" fox is", add_special_tokens=False)[1:]  # "▁fox", "▁is" pieces
    full = spm_tok.decode(prompt + output)
    detok = IncrementalDetokenizer(spm_tok, prompt_ids=prompt)
    text = "".join(detok.add([i]) for i in output) + detok.flush()
    assert text.startswith(" ") and full.endswith(text)


def test_special_tokens_skipped_or_kept(default_tok: Tokenizer) -> None:
    ids = default_tok.encode("hi<|im_end|>", add_special_tokens=False)
    assert _stream(default_tok, ids, [1])[1] == "hi"
    kept = _stream(default_tok, ids, [1], skip_special_tokens=False)[1]
    assert kept == "hi<|im_end|>"


def test_numpy_ids(default_tok: Tokenizer) -> None:
    np = pytest.importorskip("numpy")
    ids = np.asarray(default_tok.encode("numpy ids 中文"), dtype=np.int32)
    detok = IncrementalDetokenizer(default_tok)
    assert detok.add(ids) + detok.flush() == "numpy ids 中文"


# ---------------------------------------------------------------------------------------------
# stop strings


def _feed_all(m: StopMatcher, deltas: list[str]) -> tuple[str, bool]:
    out = []
    stopped = False
    for d in deltas:
        emit, stopped = m.feed(d)
        out.append(emit)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped


def test_stop_string_inside_one_delta() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("hello STOP world") == ("hello ", True)
    assert m.matched == "STOP"
    assert m.feed("more") == ("", True) and m.flush() == ""


def test_stop_string_split_over_deltas_is_held_back() -> None:
    m = StopMatcher(["</answer>"])
    assert m.feed("42 </") == ("42 ", False)  # "</" may begin the stop string
    assert m.feed("ans") == ("", False)
    assert m.feed("wer> tail") == ("", True)
    assert m.matched == "</answer>"


def test_false_alarm_is_released() -> None:
    m = StopMatcher(["</answer>"])
    assert m.feed("a </an") == ("a ", False)
    assert m.feed("d more") == ("</and more", False)
    assert m.feed(" <") == (" ", False)
    assert m.flush() == "<"  # the stream ended: release what was held


def test_earliest_of_several_stops_wins() -> None:
    m = StopMatcher(["world", "lo w", "\n\n"])
    assert m.feed("hello world") == ("hel", True) and m.matched == "lo w"


def test_the_first_stop_to_complete_wins_however_the_text_is_cut() -> None:
    # " aa" starts earlier but "a" completes first: streaming " a" must already stop there
    assert _feed_all(StopMatcher(["a", " aa"]), [" a", "a"]) == (" ", True)
    assert _feed_all(StopMatcher(["a", " aa"]), [" aa"]) == (" ", True)


def test_no_stop_strings_passes_through() -> None:
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert StopMatcher([""]).feed("x") == ("x", False)
    assert StopMatcher(None).feed("y") == ("y", False)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=30),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=3), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_stop_matcher_equals_cutting_the_full_text(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    emitted, stopped = _feed_all(StopMatcher(stops), deltas)
    # the stop string that completes first ends the text (the earliest end, then the earliest
    # start), as when the text arrives a character at a time
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    if hits:
        assert stopped and emitted == text[: min(hits)[1]]
    else:
        assert not stopped and emitted == text
