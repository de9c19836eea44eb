"""Qwen3, Mistral (sliding window) and Gemma 3 against Hugging Face transformers, through the real
ModelRunner path; their GGUF files; RoPE scaling types; load-time refusals.

Tiny random checkpoints are made with transformers in the test (no hub) and saved with
`save_pretrained`. Windowed models get a window of 8 and 45-token prompts, so full prefill,
every chunk of a chunked prefill, the cached prefix of a fresh slot and each decode step reach
past the window edge. Each check would fail without the feature: the window test also shows
that full attention gives other logits.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers
from model_support import (
    PROMPT,
    TINY,
    VOCAB,
    Driver,
    Seq,
    assert_logits_close,
    finish_gguf,
    float32_runner,
    gguf_writer,
    hf_logits,
    save_hf,
    tiny_hf_model,
)

from radix_runtime.config import ServerArgs
from radix_runtime.worker import gguf_format, loader
from radix_runtime.worker.layers.rotary import rope_parameters
from radix_runtime.worker.model_config import (
    UnsupportedModel,
    config_from_hf_dict,
    load_hf_config,
)

WINDOW = 8
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}
GEMMA3 = dict(  # local, global, local; linear-scaled global RoPE; final soft-cap
    head_dim=16,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=24,
    final_logit_softcapping=20.0,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)
# family -> (arch, config on top of model_support.TINY)
MODELS = {
    "qwen3": (
        "qwen3",
        dict(head_dim=16, rope_parameters={**YARN, "rope_theta": 1e6}),
    ),  # untied, YaRN
    "qwen3_tied": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),
    # Qwen's own windows: layers from max_window_layers on
    "qwen3_swa": (
        "qwen3",
        dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),  # fmt: skip
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "gemma3": ("gemma3", GEMMA3),
}


FAMILIES = list(MODELS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family, (arch, config) in MODELS.items():
        model = tiny_hf_model(arch, **config)
        out[family] = (save_hf(model, tmp_path_factory.mktemp(family)), model)
    return out


def test_configs_name_their_family(checkpoints):
    got = {f: load_hf_config(checkpoints[f][0]) for f in FAMILIES}
    assert got["qwen3"].architecture == "qwen3" and got["qwen3"].qk_norm
    assert got["qwen3"].rope_scaling["rope_type"] == "yarn" and not got["qwen3"].tie_word_embeddings
    assert got["qwen3_tied"].tie_word_embeddings
    assert got["qwen3_swa"].layer_windows == (0, WINDOW, WINDOW)
    no_types = transformers.Qwen3Config(**TINY, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=2).to_dict()  # fmt: skip
    no_types.pop("layer_types")  # older config.json files: derived from max_window_layers
    assert config_from_hf_dict(no_types).layer_windows == (0, 0, WINDOW)
    assert got["mistral"].architecture == "llama"
    assert got["mistral"].layer_windows == (WINDOW,) * 3
    g = got["gemma3"]
    assert g.architecture == "gemma3" and g.layer_windows == (WINDOW, 0, WINDOW)
    assert g.softmax_scale == pytest.approx(24**-0.5) and g.final_logit_softcapping == 20.0
    assert g.rope_scaling == {"rope_type": "linear", "factor": 2.0} and g.rope_local_theta == 1e4


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family, page_size):
    """Full prefill, chunked prefill crossing the window edge, a cached prefix read by a fresh
    slot, greedy decode, and a mixed batch: every row within 1e-4 of transformers."""
    folder, hf = checkpoints[family]
    d = Driver(float32_runner(folder, page_size))
    ref = hf_logits(hf, PROMPT)

    a = Seq(slot=0)
    (res,), (logits,) = d.forward([d.req(a, PROMPT)])
    assert_logits_close(logits, ref)
    assert res.next_id == int(ref[-1].argmax())

    b = Seq(slot=1)
    bounds = [0, 5, 13, 27, len(PROMPT)]  # chunks shorter and longer than the window
    for lo, hi in zip(bounds, bounds[1:]):
        last = hi == len(PROMPT)
        nxt = -1 if last else PROMPT[hi]
        (res,), (logits,) = d.forward([d.req(b, PROMPT[lo:hi], sample=last, next_token=nxt)])
        assert_logits_close(logits, ref[lo:hi])

    shared = 28  # a fresh slot reads 28 cached tokens (window 8: most of them out of reach)
    tail = [int(x) for x in np.random.default_rng(1).integers(3, VOCAB, size=10)]
    c = Seq(slot=2, pages=a.pages[: math.ceil(shared / page_size)], cached=shared)
    if shared % page_size:
        c.pages, c.cached = c.pages[:-1], shared - shared % page_size
        tail = PROMPT[c.cached : shared] + tail
    start = c.cached
    (res,), (logits,) = d.forward([d.req(c, tail)])
    assert_logits_close(logits, hf_logits(hf, PROMPT[:start] + tail)[start:])

    seq = PROMPT + [int(ref[-1].argmax())]
    other = PROMPT[10:40]
    n = Seq(slot=3)
    for i in range(4):  # decode of `a`; on step 2 a newcomer's prefill joins the batch
        reqs = [d.req(a, [seq[-1]])] + ([d.req(n, other)] if i == 2 else [])
        results, logits = d.forward(reqs)
        full = hf_logits(hf, seq)
        assert_logits_close(logits[0], full[-1:])
        assert results[0].next_id == int(full[-1].argmax())
        if i == 2:
            assert_logits_close(logits[1], hf_logits(hf, other))
        seq.append(results[0].next_id)


@pytest.mark.parametrize("family", ["qwen3_swa", "mistral", "gemma3"])
def test_the_window_changes_the_logits(checkpoints, family):
    """The window matters for these prompts: full attention gives other logits (so the match
    above is the window's doing)."""
    _, hf = checkpoints[family]
    saved = hf.config.sliding_window
    try:
        hf.config.sliding_window = 4096
        full = hf_logits(hf, PROMPT)
    finally:
        hf.config.sliding_window = saved
    windowed = hf_logits(hf, PROMPT)
    assert (full[WINDOW:] - windowed[WINDOW:]).abs().max() > 1e-2
    assert (full[:WINDOW] - windowed[:WINDOW]).abs().max() < 1e-5


def test_multimodal_gemma3_checkpoint_loads_its_language_model(checkpoints, tmp_path):
    """Gemma3ForConditionalGeneration folders (4B-27B): text_config, prefixed tensor names and
    vision weights, which are skipped."""
    import json

    from safetensors.torch import load_file, save_file

    folder, hf = checkpoints["gemma3"]
    with open(os.path.join(folder, "config.json")) as f:
        text = json.load(f)
    wrapped = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": text,
        "vision_config": {"hidden_size": 8},
    }
    with open(tmp_path / "config.json", "w") as f:
        json.dump(wrapped, f)
    tensors = {
        k.replace("model.", "model.language_model.", 1): v
        for k, v in load_file(os.path.join(folder, "model.safetensors")).items()
    }
    tensors["model.vision_tower.patch.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    runner = float32_runner(str(tmp_path), 4)
    assert runner.config.eos_token_ids == (1, 106)
    (res,), (logits,) = Driver(runner).forward([Driver(runner).req(Seq(slot=0), PROMPT[:20])])
    assert_logits_close(logits, hf_logits(hf, PROMPT[:20]))


# ---------------------------------------------------------------------------------------------
# GGUF: Qwen3 and Gemma 3 files written the way llama.cpp's converter writes them

_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_LAYER_ARCH = {
    "qwen3": {"post_attention_layernorm": "ffn_norm"},
    "gemma3": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}


def _gguf_name(hf_name: str, arch: str) -> str:
    glob = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in glob:
        return glob[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    part = ".".join(rest[:-1])
    names = {**_GGUF_LAYER, **_GGUF_LAYER_ARCH[arch]}
    return f"blk.{layer}.{names[part]}.{rest[-1]}"


def write_gguf(model: transformers.PreTrainedModel, path: str, arch: str) -> None:
    c = model.config
    w = gguf_writer(model, path, arch, [f"<t{i}>" for i in range(VOCAB)])
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if arch == "qwen3":
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(YARN["factor"])
        w.add_rope_scaling_orig_ctx_len(YARN["original_max_position_embeddings"])
    else:  # gemma3: llama.cpp's fixed pattern (every 6th layer global), local base 10,000
        w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
        w.add_sliding_window(c.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c.rope_parameters["full_attention"]["factor"])
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = p.numpy().astype(np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp stores Gemma's norms as (1 + w)
        w.add_tensor(_gguf_name(name, arch), arr)
    finish_gguf(w)


def _gemma3_like_llama_cpp() -> transformers.PreTrainedModel:
    """A Gemma 3 with what a GGUF implies: 6 layers, the 6th global, head_dim scale, no cap."""
    return tiny_hf_model(
        "gemma3",
        seed=1,
        num_hidden_layers=6,
        head_dim=16,
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_gguf_logits_match_transformers(checkpoints, arch, tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "cache"))
    hf = checkpoints["qwen3"][1] if arch == "qwen3" else _gemma3_like_llama_cpp()
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(hf, path, arch)
    c = gguf_format.config_from_gguf(gguf_format.open_gguf(path))
    assert c.architecture == arch and c.qk_norm
    if arch == "gemma3":
        assert c.layer_windows == (WINDOW,) * 5 + (0,)
    runner = ModelRunnerFor(path)  # converts the GGUF (and caches the conversion)
    d = Driver(runner)
    (res,), (logits,) = d.forward([d.req(Seq(slot=0), PROMPT)])
    assert_logits_close(logits, hf_logits(hf, PROMPT))
    again = loader.load_model(ServerArgs(model=path), torch.device("cpu"), torch.float32)
    assert again.cache_hit is True and again.config == runner.config
    for (name, x), (_, y) in zip(runner.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(x, y), name


def ModelRunnerFor(path: str):  # noqa: N802 (reads like the class it builds)
    from radix_runtime.worker.model_runner import ModelRunner

    return ModelRunner(
        ServerArgs(
            model=path,
            max_total_tokens=512,
            page_size=4,
            max_running_requests=4,
            device="cpu",
            dtype="float32",
        )  # fmt: skip
    )


# ---------------------------------------------------------------------------------------------
# RoPE scaling types against transformers' own computation


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "linear", "factor": 4.0},
        {**YARN},
        {**YARN, "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.3},
        {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],  # fmt: skip
)
def test_rope_scaling_matches_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        max_position_embeddings=512,
        rope_parameters={**params, "rope_theta": 50000.0},
    )
    want_freq, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_cfg, "cpu")
    c = config_from_hf_dict(hf_cfg.to_dict())
    got_freq, got_factor = rope_parameters(
        c.head_dim, c.rope_theta, c.rope_scaling, None, c.max_position_embeddings
    )
    torch.testing.assert_close(got_freq, want_freq, rtol=1e-6, atol=0)
    assert got_factor == pytest.approx(want_factor)


# ---------------------------------------------------------------------------------------------
# refusals


def _cfg(**over) -> dict:
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2}  # fmt: skip
    return {**base, **over}


@pytest.mark.parametrize(
    "cfg,field",
    [
        (_cfg(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type"),
        (
            _cfg(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
            "rope_parameters.rope_type",
        ),
        (_cfg(rope_scaling={"type": "su"}), "rope_scaling.rope_type"),
        (_cfg(architectures=["PhiForCausalLM"], model_type="phi"), "architectures"),
        (_cfg(architectures=None, model_type="gpt2"), "model_type"),
        (
            _cfg(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8),
            "num_experts",
        ),
        (_cfg(architectures=["MixtralForCausalLM"], num_local_experts=8), "num_local_experts"),
        (_cfg(quantization_config={"quant_method": "awq"}), "quantization_config"),
        (_cfg(sliding_window=4096), "sliding_window"),
        (_cfg(hidden_act="gelu"), "hidden_act"),
        (_cfg(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (
            _cfg(
                architectures=["Gemma3ForCausalLM"],
                model_type="gemma3_text",
                attn_logit_softcapping=50.0,
                sliding_window=8,
            ),
            "attn_logit_softcapping",
        ),
        (
            _cfg(
                architectures=["Gemma3ForCausalLM"],
                model_type="gemma3_text",
                use_bidirectional_attention=True,
                sliding_window=8,
            ),
            "use_bidirectional_attention",
        ),
    ],  # fmt: skip
)
def test_unsupported_configs_are_refused_naming_the_field(cfg, field):
    with pytest.raises(UnsupportedModel, match=field):
        config_from_hf_dict(cfg)


def test_serve_refuses_at_load_and_leaves_nothing_running(tmp_path):
    """The CLI exits non-zero with the field named, before any child process starts."""
    import json

    with open(tmp_path / "config.json", "w") as f:
        json.dump(_cfg(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), f)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-m", "radix_runtime", "serve", "--model", str(tmp_path),
         "--port", "0"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "rope_scaling.rope_type = 'dynamic' is not supported" in proc.stderr
    # no worker or scheduler was spawned: nothing of ours has this folder on its command line
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in ps


@pytest.mark.parametrize(
    "name,params_b",
    [("qwen3-8b", 8.19), ("mistral-7b", 7.24), ("gemma-3-12b", 11.77), ("llama-3.1-8b", 8.03)],
)
def test_shipped_benchmark_shapes(name, params_b):
    """The dummy configs bench/gpu_worker.py runs build their family at the published size."""
    from radix_runtime.model_source import dummy_config_path
    from radix_runtime.worker.models.registry import MODEL_CLASSES, build_model

    c = load_hf_config(dummy_config_path(name))
    model = build_model(c, torch.device("meta"), torch.bfloat16)
    assert type(model) is MODEL_CLASSES[c.architecture]
    total = sum(p.numel() for p in model.parameters())
    assert total / 1e9 == pytest.approx(params_b, abs=0.01)


# ---------------------------------------------------------------------------------------------
# chat templates: the constructs each family's template uses render as transformers renders them
# (templates written for this test in each family's style; the published Qwen3, Mistral v0.3
# and Gemma 3 templates use these constructs)

_QWEN3_STYLE = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" and not message.content.startswith('<tool') %}
{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == "assistant" %}{{- '<|im_start|>assistant\\n' + message.content }}
{%- for call in message.tool_calls or [] %}{%- set call = call.function %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}' }}
{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
{{- '\\n</tool_response><|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}{%- endif %}"""

_MISTRAL_STYLE = """{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = messages | selectattr("role", "equalto", "user") | list %}
{%- for message in messages | rejectattr("role", "equalto", "tool") | selectattr("tool_calls", "undefined") %}
{%- if (message["role"] == "user") != (loop.index0 % 2 == 0) %}
{{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
{%- endif %}{%- endfor %}{{- bos_token }}
{%- for message in messages %}{%- if message["role"] == "user" %}{{- "[INST] " }}
{%- if tools is not none and (message == user_messages[-1]) %}{{- "[AVAILABLE_TOOLS] [" }}
{%- for tool in tools %}{%- for key, val in tool.function.items() if key != "return" %}
{{- '"' + key + '": ' + (val|tojson) }}{%- if not loop.last %}{{- ", " }}{%- endif %}{%- endfor %}
{%- endfor %}{{- "][/AVAILABLE_TOOLS]" }}{%- endif %}{{- message["content"] + "[/INST]" }}
{%- elif message.tool_calls is defined %}{{- "[TOOL_CALLS] " + (message.tool_calls|map(attribute="function")|list|tojson) }}
{%- elif message["role"] == "tool" %}{{- '[TOOL_RESULTS] {"content": ' + message.content|string + "}[/TOOL_RESULTS]" }}
{%- else %}{{- " " + message["content"] + eos_token }}{%- endif %}{%- endfor %}"""

_GEMMA3_STYLE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
{%- endif -%}{%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
{{- message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""

_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
_CHAT = [{"role": "user", "content": " Hi <there> & 'you' "}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Weather in Paris?"}]  # fmt: skip
_CALLS = _CHAT + [
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]  # fmt: skip


@pytest.mark.parametrize(
    "template,messages,kwargs",
    [
        (_QWEN3_STYLE, _CHAT, {}),
        (_QWEN3_STYLE, _CALLS, {"tools": _TOOLS, "enable_thinking": False}),
        (_MISTRAL_STYLE, _CHAT, {}),
        (_MISTRAL_STYLE, _CALLS, {"tools": _TOOLS}),
        (_GEMMA3_STYLE, [{"role": "system", "content": "Be brief."}, *_CHAT], {}),
    ],
    ids=["qwen3", "qwen3-tools", "mistral", "mistral-tools", "gemma3"],
)
def test_family_chat_templates_render_like_transformers(template, messages, kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    from radix_runtime.tokenizer.chat_template import render_chat

    special = {"bos_token": "<s>", "eos_token": "</s>"}
    want = render_jinja_template(
        [messages], chat_template=template, add_generation_prompt=True, **special, **kwargs
    )[0][0]
    assert render_chat(template, messages, True, special, **kwargs) == want
    if "tools" in kwargs:
        assert '"get_weather"' in want


def test_gemma3_template_refuses_non_alternating_roles():
    from radix_runtime.tokenizer.chat_template import render_chat

    with pytest.raises(ValueError, match="must alternate"):
        render_chat(_GEMMA3_STYLE, [_CHAT[0], _CHAT[0]], True, {"bos_token": "<bos>"})


def test_gemma3_text_config_defaults_match_transformers():
    """A released multimodal config's text_config leaves fields at transformers' defaults."""
    text = {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
            "num_hidden_layers": 34, "sliding_window": 1024,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}  # fmt: skip
    c = config_from_hf_dict(
        {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
         "eos_token_id": [1, 106], "text_config": text}
    )  # fmt: skip
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    assert (c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps) == (
        hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim,
        hf.rms_norm_eps,
    )  # fmt: skip
    assert c.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert c.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert c.softmax_scale == hf.query_pre_attn_scalar**-0.5 and c.tie_word_embeddings
    assert c.layer_windows == tuple(1024 if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert c.eos_token_ids == (1, 106)
