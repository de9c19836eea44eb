"""Chat templates: rendering like transformers, message validation, role markers for the DSL."""

from __future__ import annotations

import pytest

from radix_runtime import model_source
from radix_runtime.model_source import ModelNotFound
from radix_runtime.tokenizer import CHATML_TEMPLATE, Tokenizer, byte_tokenizer, load_tokenizer

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
    "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)


def _tok(template: str | None, bos: str | None = None, eos: str | None = None) -> Tokenizer:
    return Tokenizer(
        byte_tokenizer().backend,
        vocab_size=259,
        bos_token=bos,
        eos_token=eos,
        chat_template=template,
    )


@pytest.fixture(scope="module")
def default_tok() -> Tokenizer:
    try:
        return load_tokenizer(model_source.default_gguf_path())
    except ModelNotFound as e:
        pytest.skip(str(e))


USER = [{"role": "user", "content": "Hi"}]


def test_default_template(default_tok: Tokenizer) -> None:
    assert default_tok.apply_chat_template(USER) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    chat = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {"role": "assistant", "content": "Hello"},
    ]
    assert default_tok.apply_chat_template(chat, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n"
    )


def test_chatml_fallback_without_template() -> None:
    tok = _tok(None)
    assert tok.chat_template is None
    assert (
        tok.apply_chat_template(USER) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(USER, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
    assert "im_start" in CHATML_TEMPLATE


def test_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    out = _tok(None).apply_chat_template([{"role": "user", "content": parts}], False)
    assert out == "<|im_start|>user\nfirst\nsecond<|im_end|>\n"


def test_tool_call_turn_may_have_null_content() -> None:
    msgs = [*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert "<|im_start|>assistant\n<|im_end|>" in _tok(None).apply_chat_template(msgs, False)


@pytest.mark.parametrize(
    "messages, words",
    [
        ([], "non-empty"),
        ("hello", "non-empty"),
        (["hello"], "object"),
        ([{"content": "no role"}], "role"),
        ([{"role": "wizard", "content": "x"}], "wizard"),
        ([{"role": "user", "content": 42}], "content"),
        ([{"role": "user", "content": {"text": "x"}}], "content"),
        ([{"role": "user"}], "missing"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text"),
        ([{"role": "user", "content": ["bare string part"]}], "text parts"),
    ],
)
def test_invalid_messages_raise_value_error(messages, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        _tok(None).apply_chat_template(messages)


def test_template_errors_become_value_errors() -> None:
    with pytest.raises(ValueError, match="must alternate"):
        _tok(LLAMA2, "<s>", "</s>").apply_chat_template([*USER, *USER])
    with pytest.raises(ValueError, match="does not parse"):
        _tok("{% for m in messages %}").apply_chat_template(USER)


def test_jinja_environment_like_transformers() -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}"
        "|{{ tools | tojson }}|{{ strftime_now('%Y') | length }}|{{ bos_token }}|{{ ''.__class__ }}|"
        "{{ custom }}"
    )
    tok = _tok(template, bos="<|im_start|>")
    out = tok.apply_chat_template(
        [*USER, *USER, *USER], tools=[{"name": "f", "description": "a < b & ü"}], custom="kw"
    )
    # loopcontrols break after two; tojson keeps <, & and ü as they are; the sandbox hides __class__
    assert out == 'HiHi|[{"name": "f", "description": "a < b & ü"}]|4|<|im_start|>||kw'


def test_trim_and_lstrip_blocks() -> None:
    template = (
        "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    )
    assert _tok(template).apply_chat_template(USER) == "Hi\n"


# ---------------------------------------------------------------------------------------------
# role markers


def test_role_markers_default(default_tok: Tokenizer) -> None:
    m = default_tok.role_markers()
    assert m["system"] == ("<|im_start|>system\n", "<|im_end|>\n")
    assert m["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert m["assistant"] == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert m["generation_prompt"] == "<|im_start|>assistant\n"
    assert m["begin"] == ""
    assert m["default_system"].startswith("<|im_start|>system\nYou are a helpful AI assistant")


@pytest.mark.parametrize(
    "template, bos, expected",
    [
        (
            LLAMA3,
            "<|begin_of_text|>",
            {
                "begin": "<|begin_of_text|>",
                "system": ("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>"),
                "user": ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
                "assistant": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
                "generation_prompt": "<|start_header_id|>assistant<|end_header_id|>\n\n",
            },
        ),
        (
            # the system text lives inside the first user turn: no system markers
            LLAMA2,
            "<s>",
            {
                "begin": "",
                "system": None,
                "user": ("<s>[INST] ", " [/INST]"),
                "assistant": (" ", " </s>"),
                "generation_prompt": "",
            },
        ),
        (
            GEMMA,
            "<bos>",
            {
                "begin": "<bos>",
                "system": None,
                "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
                "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n"),
                "generation_prompt": "<start_of_turn>model\n",
            },
        ),
        (
            None,  # ChatML fallback
            None,
            {
                "begin": "",
                "system": ("<|im_start|>system\n", "<|im_end|>\n"),
                "user": ("<|im_start|>user\n", "<|im_end|>\n"),
                "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
                "generation_prompt": "<|im_start|>assistant\n",
            },
        ),
    ],
)
def test_role_markers_of_known_templates(template, bos, expected) -> None:
    markers = _tok(template, bos=bos, eos="</s>").role_markers()
    assert {k: markers[k] for k in expected} == expected


@pytest.mark.parametrize(
    "template, bos", [(LLAMA3, "<|begin_of_text|>"), (None, None), ("default", None)]
)
def test_markers_rebuild_the_rendered_prompt(template, bos, default_tok: Tokenizer) -> None:
    tok = default_tok if template == "default" else _tok(template, bos=bos)
    m = tok.role_markers()
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ]
    rebuilt = m["begin"] + "".join(
        m[msg["role"]][0] + msg["content"] + m[msg["role"]][1] for msg in chat
    )
    assert rebuilt + m["generation_prompt"] == tok.apply_chat_template(chat)
    # without a system message the template's default system turn comes first
    no_system = m["begin"] + m["default_system"] + m["user"][0] + "U1" + m["user"][1]
    assert no_system == tok.apply_chat_template(chat[1:2], add_generation_prompt=False)


def test_template_that_drops_content_has_no_markers() -> None:
    with pytest.raises(ValueError, match="role markers"):
        _tok("{% for m in messages %}{{ m.role }}{% endfor %}").role_markers()
