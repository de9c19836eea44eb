"""Tokenizers from every source: the default GGUF (against transformers' own GGUF tokenizer), a
sentencepiece GGUF, HF folders with tokenizer.json or only tokenizer.model (against
sentencepiece itself), and the 256-byte fallback."""

from __future__ import annotations

import json
import os
import random

import pytest

from radix_runtime import model_source
from radix_runtime.model_source import ModelNotFound, ModelSource
from radix_runtime.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer
from radix_runtime.utils.gguf_header import read_gguf_metadata

sentencepiece = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

SAMPLES = [
    "Hello world",
    "The capital of France is Paris.",
    "1234567890 3.14159 -42 1e10 2024-01-31 99,999",
    "naïve café déjà vu, Ünïcödé straße",
    "emoji 😀🎉👍🏽 👨‍👩‍👧 ❤️",
    "中文字符 日本語のテキスト 한국어 텍스트",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tpass",
    "   leading spaces",
    "trailing spaces   ",
    "multiple   inner    spaces\n\n\nand newlines\r\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|><|endoftext|>",
    "don't won't I'm we'll they've she'd",
    "",
    " ",
    "a",
    "URL: https://example.com/path?q=1&x=%20",
    "mixed Ω≈ç√∫ ∑ ℵ ∞ ±",
]


DIGIT_SPLIT_SAMPLES = ["x = [\n    1,\n    2]", "a\n\n1. first", "½ cup, 2² = 4, ③", "col  42"]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    pool = (
        list("abcdefghij XYZ0123456789.,!?'\n\t")
        + list("éüßñ中文日本😀🎉ÅΩ")
        + [
            "<|im_start|>",
            "<|im_end|>",
            "  ",
            "'s",
        ]
    )
    return ["".join(rng.choice(pool) for _ in range(rng.randint(0, 40))) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# the default model's GGUF vocabulary


@pytest.fixture(scope="module")
def default_path() -> str:
    try:
        return model_source.default_gguf_path()
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def default_tok(default_path: str) -> Tokenizer:
    return load_tokenizer(default_path)


def _transformers_gguf_tokenizer(path: str):
    """transformers' own GGUF tokenizer. Its conversion functions, when this version has them:
    AutoTokenizer.from_pretrained(gguf_file=...) builds the same backend through the same
    functions, but first parses the file with gguf.GGUFReader (~10 s on a 2-core machine)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path)
        )
    architecture, tokenizer_dict, config = get_gguf_tokenizer(path)
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return TokenizersBackend(tokenizer_object=backend, **config)


def _smollm2_original(ref):
    """SmolLM2's tokenizer.json pre-tokenizer (Digits(individual_digits) then GPT-2 ByteLevel,
    = llama.cpp's `smollm` split) around the vocabulary transformers read from the file."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers

    original = HFTokenizer.from_str(ref.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return original


def _split_digits_matter(text: str) -> bool:
    """Where splitting digits first changes the words: two or more spaces before a digit (GPT-2's
    regex gives the last space to the number) or a non-ASCII number character (½ ² ③)."""
    regex = pytest.importorskip("regex")
    return bool(regex.search(r"\s{2,}\p{N}|(?![0-9])\p{N}", text))


def test_default_gguf_matches_transformers(default_path: str, default_tok: Tokenizer) -> None:
    """Same ids as transformers' GGUF tokenizer, except where transformers ignores the file's
    pre-tokenizer name `smollm` (it splits with the plain GPT-2 regex): there the ids are those of
    SmolLM2's own tokenizer.json rule."""
    pytest.importorskip("transformers")
    ref = _transformers_gguf_tokenizer(default_path)
    original = _smollm2_original(ref)
    texts = SAMPLES + DIGIT_SPLIT_SAMPLES + _random_texts(300)
    assert sum(map(_split_digits_matter, texts)) > 10
    for text in texts:
        ours = default_tok.encode(text)
        assert ours == original.encode(text).ids, text
        expected = ref.encode(text, add_special_tokens=True)
        if not _split_digits_matter(text):
            assert ours == expected, text
        assert default_tok.decode(expected, skip_special_tokens=False) == ref.decode(expected), text
        assert default_tok.decode(expected) == ref.decode(expected, skip_special_tokens=True), text


def test_default_gguf_facts(default_tok: Tokenizer) -> None:
    tok = default_tok
    assert tok.vocab_size == 49152
    assert not tok.add_bos_token  # SmolLM2's GGUF says add_bos_token = false
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False)
    im_start, im_end, eot = (
        tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    )
    assert tok.encode("<|im_start|>") == [im_start]
    assert tok.eos_token_ids[0] == im_end == 2  # the file's eos, then <|endoftext|>
    assert eot in tok.eos_token_ids
    assert tok.is_special(im_end) and not tok.is_special(tok.encode("Hi")[0])
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    # every digit is its own token (SmolLM's pre-tokenizer)
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    # ... every Unicode number too (llama.cpp's \p{N} split, the Digits rule of SmolLM2's
    # tokenizer.json). transformers' GGUF loader uses the plain GPT-2 regex and keeps " ½" whole.
    assert [tok.decode([i]) for i in tok.encode(" ½")] == [" ", "½"]


def test_load_by_name_and_source(default_path: str, default_tok: Tokenizer) -> None:
    by_source = load_tokenizer(ModelSource("gguf", default_path, "x"))
    assert by_source.encode("same ids?") == default_tok.encode("same ids?")
    with pytest.raises(ModelNotFound):
        load_tokenizer("/no/such/model")


def test_encode_prompt_adds_bos_once(corpus: str, tmp_path) -> None:
    _train_spm(corpus, str(tmp_path / "tokenizer"), "bpe", normalization_rule_name="identity")
    tok = load_tokenizer(str(tmp_path))  # sentencepiece: adds BOS
    assert tok.add_bos_token and tok.bos_token == "<s>"
    assert tok.encode_prompt("hello") == tok.encode("hello")
    # a template that writes BOS itself does not get a second one
    assert tok.encode_prompt("<s>hello") == tok.encode("hello")
    tok.chat_template = "{{ bos_token }}{{ messages[0]['content'] }}"
    assert tok.encode_chat([{"role": "user", "content": "hello"}]) == tok.encode("hello")


def test_token_bytes_rebuild_text(default_tok: Tokenizer) -> None:
    for text in SAMPLES:
        ids = default_tok.encode(text, add_special_tokens=False)
        assert b"".join(default_tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    # an emoji spread over several tokens: each has part of its bytes, none is U+FFFD
    parts = [default_tok.token_bytes(i) for i in default_tok.encode("😀")]
    assert len(parts) > 1 and b"".join(parts) == "😀".encode()


# ---------------------------------------------------------------------------------------------
# training tiny tokenizers


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = random.Random(1)
    # fmt: off
    words = [
        "hello", "world", "token", "radix", "cache", "serve", "the", "quick", "brown", "fox",
        "naïve", "café", "日本語", "テスト", "über", "straße", "😀", "emoji", "a", "is", "of", "12",
        "345", "code", "def", "return", "print", "(x)", "{}", "2024",
    ]
    # fmt: on
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 15))) for _ in range(3000)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return str(path)


def _train_spm(corpus: str, prefix: str, model_type: str, **kw) -> str:
    sentencepiece.SentencePieceTrainer.train(
        input=corpus,
        model_prefix=prefix,
        vocab_size=450 if model_type == "bpe" else 320,
        model_type=model_type,
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
        **kw,
    )
    return prefix + ".model"


SPM_TEXTS = [s for s in SAMPLES if "<|" not in s] + [
    "hello world",
    "Zebra xylophone QQ",
    "ｈｅｌｌｏ ① ﬁ",
]


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
@pytest.mark.parametrize("normalization", ["identity", "nmt_nfkc"])
def test_sentencepiece_folder_matches_sentencepiece(
    corpus: str, tmp_path, model_type: str, normalization: str
) -> None:
    model = _train_spm(
        corpus, str(tmp_path / "tokenizer"), model_type, normalization_rule_name=normalization
    )
    ref = sentencepiece.SentencePieceProcessor(model_file=model)
    tok = load_tokenizer(str(tmp_path))  # a folder holding only tokenizer.model
    assert tok.vocab_size == ref.get_piece_size()
    assert tok.bos_token_id == ref.bos_id() and tok.eos_token_ids == [ref.eos_id()]
    assert tok.add_bos_token  # LlamaTokenizer's default
    with open(corpus, encoding="utf-8") as f:
        corpus_lines = f.read().splitlines()[:100]
    for text in SPM_TEXTS + corpus_lines:
        ids = ref.encode(text)
        assert tok.encode(text, add_special_tokens=False) == ids, text
        assert tok.encode(text) == [ref.bos_id(), *ids]
        assert tok.decode([ref.bos_id(), *ids, ref.eos_id()]) == ref.decode(ids), text


def test_sentencepiece_folder_added_tokens_and_template(corpus: str, tmp_path) -> None:
    _train_spm(corpus, str(tmp_path / "tokenizer"), "bpe", normalization_rule_name="identity")
    config = {
        "add_bos_token": False,
        "added_tokens_decoder": {
            "450": {"content": "<|im_start|>", "special": True},
            "451": {"content": "<|im_end|>", "special": True},
        },
        "eos_token": "<|im_end|>",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path))
    assert tok.token_to_id("<|im_start|>") == 450 and tok.token_to_id("<|im_end|>") == 451
    ids = tok.encode("<|im_start|>user\nhello world<|im_end|>")
    assert ids[0] == 450 and ids[-1] == 451  # no BOS: add_bos_token false
    assert tok.decode(ids) == "user\nhello world"
    assert tok.eos_token_ids[0] == 451 and tok.vocab_size == 452


def test_sentencepiece_gguf_matches_sentencepiece(corpus: str, tmp_path) -> None:
    # a GGUF cannot say "squeeze spaces" (llama.cpp never does); Llama's own model does not either
    model = _train_spm(
        corpus,
        str(tmp_path / "sp"),
        "bpe",
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        control_symbols=["<|im_end|>"],
    )
    ref = sentencepiece.SentencePieceProcessor(model_file=model)
    path = str(tmp_path / "spm.gguf")
    _write_spm_gguf(ref, path)
    tok = load_tokenizer(path)
    assert tok.add_bos_token and tok.bos_token_id == 1
    for text in SPM_TEXTS:
        assert tok.encode(text) == [1, *ref.encode(text)], text
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text)), text
        # token bytes: ▁ is a space (the dummy prefix too), <0xNN> pieces are single bytes
        pieces = b"".join(tok.token_bytes(i) for i in ref.encode(text))
        assert pieces == (" " + text).encode() if text else pieces == b"", text
    # a control token is one id and skipped in decoding; the text after it gets its ▁ (llama.cpp)
    im_end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("hello<|im_end|>world", add_special_tokens=False)
    assert im_end in ids and tok.decode(ids, skip_special_tokens=False) == "hello<|im_end|> world"


def _write_spm_gguf(ref, path: str) -> None:
    n = ref.get_piece_size()
    types = [
        2 if ref.is_unknown(i) else 3 if ref.is_control(i) else 6 if ref.is_byte(i) else 1
        for i in range(n)
    ]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([ref.id_to_piece(i) for i in range(n)])
    w.add_token_scores([ref.get_score(i) for i in range(n)])
    w.add_token_types(types)
    w.add_bos_token_id(ref.bos_id())
    w.add_eos_token_id(ref.eos_id())
    w.add_unk_token_id(ref.unk_id())
    w.add_string("test.string", "ünïcode")
    w.add_array("test.floats", [0.5, -1.25])
    w.add_uint64("test.big", 2**40)
    w.add_bool("test.flag", False)
    w.add_int8("test.neg", -3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_metadata_reader(corpus: str, tmp_path) -> None:
    model = _train_spm(corpus, str(tmp_path / "sp"), "bpe", normalization_rule_name="identity")
    path = str(tmp_path / "m.gguf")
    _write_spm_gguf(sentencepiece.SentencePieceProcessor(model_file=model), path)
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama"
    assert meta["test.string"] == "ünïcode" and meta["test.floats"] == [0.5, -1.25]
    assert meta["test.big"] == 2**40 and meta["test.flag"] is False and meta["test.neg"] == -3
    assert len(meta["tokenizer.ggml.tokens"]) == 450


# ---------------------------------------------------------------------------------------------
# HF folder with tokenizer.json


@pytest.fixture(scope="module")
def bpe_folder(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train([corpus], trainer)
    folder = tmp_path_factory.mktemp("bpe")
    hf.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "<|endoftext|>", "special": True},
        "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    return str(folder)


def test_tokenizer_json_folder(bpe_folder: str) -> None:
    tok = load_tokenizer(bpe_folder)
    bos, eot, im_start, im_end = (
        tok.token_to_id(t) for t in ("<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
    )
    assert tok.bos_token_id == bos and tok.add_bos_token
    assert tok.eos_token_ids == [eot, im_end]  # tokenizer_config eos, then generation_config
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids[0] == bos and tok.encode(text, add_special_tokens=False) == ids[1:]
        if "<|" not in text:
            assert tok.decode(ids) == text
    ids = tok.encode("<|im_start|>user\nhello<|im_end|>", add_special_tokens=False)
    assert ids[0] == im_start and ids[-1] == im_end
    assert tok.decode(ids) == "user\nhello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhello<|im_end|>"
    # the template writes BOS itself: encode_chat must not add a second one
    chat = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert chat[0] == bos and chat[1] == im_start and bos not in chat[1:]


def test_tokenizer_json_template_sources(bpe_folder: str, tmp_path) -> None:
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(bpe_folder, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT"},
    ]
    config.pop("add_bos_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(folder))
    assert tok.chat_template == "DEFAULT"
    assert not tok.add_bos_token  # tokenizer.json's own post-processor adds nothing
    (folder / "chat_template.jinja").write_text("JINJA")
    assert load_tokenizer(str(folder)).chat_template == "JINJA"


def test_dummy_source_uses_files_next_to_config(bpe_folder: str) -> None:
    config = os.path.join(bpe_folder, "config.json")
    with open(config, "w") as f:
        json.dump({"eos_token_id": 1}, f)
    tok = load_tokenizer(ModelSource("dummy", config, "tiny"))
    assert tok.token_to_id("<s>") == tok.bos_token_id and 1 in tok.eos_token_ids
    os.remove(config)


def test_byte_tokenizer_round_trip() -> None:
    tok = byte_tokenizer()
    for text in SAMPLES:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode("<|im_end|>") == [tok.eos_token_ids[0]]


def _write_bpe_gguf(folder: str, path: str, pre: str) -> None:
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        model = json.load(f)["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<s>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template("{{ messages[0]['content'] }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_byte_level_gguf_pre_tokenizers_match_transformers(
    bpe_folder: str, tmp_path, pre: str
) -> None:
    pytest.importorskip("transformers")
    path = str(tmp_path / "bpe.gguf")
    _write_bpe_gguf(bpe_folder, path, pre)
    ref = _transformers_gguf_tokenizer(path)
    tok = load_tokenizer(path)
    assert not tok.add_bos_token and tok.chat_template == "{{ messages[0]['content'] }}"
    for text in SAMPLES + DIGIT_SPLIT_SAMPLES + _random_texts(100, seed=2):
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_unknown_gguf_pre_tokenizer_falls_back_to_gpt2(bpe_folder: str, tmp_path, caplog) -> None:
    a, b = str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")
    _write_bpe_gguf(bpe_folder, a, "some-new-model")
    _write_bpe_gguf(bpe_folder, b, "gpt2")
    with caplog.at_level("WARNING"):
        unknown = load_tokenizer(a)
    assert "some-new-model" in caplog.text
    text = "don't   split 2024 like llama3's 12345"
    assert unknown.encode(text) == load_tokenizer(b).encode(text)


def test_encode_takes_the_offset_free_path_with_the_same_ids(default_tok: Tokenizer) -> None:
    """`encode` goes through the backend's `encode_batch_fast` (no offsets tracked), and its ids
    are those of the backend's full `encode`, special tokens and BOS handling included."""
    backend = default_tok.backend
    if not hasattr(backend, "encode_batch_fast"):
        pytest.skip("tokenizers < 0.20 has no encode_batch_fast")
    texts = [*SAMPLES, *_random_texts(50), "x " * 3000]
    for add in (True, False):
        for text in texts:
            assert default_tok.encode(text, add) == backend.encode(text, add_special_tokens=add).ids
    calls = []
    fast = default_tok._encode_fast
    default_tok._encode_fast = lambda batch, **kw: calls.append(batch) or fast(batch, **kw)
    try:
        default_tok.encode("Hello world")
    finally:
        default_tok._encode_fast = fast
    assert calls == [["Hello world"]]
