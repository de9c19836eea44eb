"""Loading: shipped dummy configs, GGUF metadata and Q/K un-permutation, the conversion cache."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
import transformers
from model_support import assert_logits_close, finish_gguf, gguf_writer, hf_logits, tiny_hf_model

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.model_source import dummy_config_path
from radix_runtime.worker import gguf_format, loader
from radix_runtime.worker.layers import rope_inv_freq
from radix_runtime.worker.model_config import load_hf_config
from radix_runtime.worker.model_runner import ModelRunner

CPU = torch.device("cpu")


def test_dummy_weights_are_deterministic_by_seed():
    args = ServerArgs(model="tiny-llama", load_format="dummy")
    first = loader.load_model(args, CPU, torch.float32)
    again = loader.load_model(args, CPU, torch.float32)
    other = loader.load_model(args.replace(seed=1), CPU, torch.float32)
    with open(dummy_config_path("tiny-llama")) as f:
        shipped = json.load(f)
    c = first.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        shipped["hidden_size"],
        shipped["num_hidden_layers"],
        shipped["num_attention_heads"],
        shipped["num_key_value_heads"],
        shipped["head_dim"],
        shipped["vocab_size"],
    )
    w = dict(first.model.named_parameters())
    qkv = w["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (c.q_size + 2 * c.kv_size, c.hidden_size)
    assert abs(qkv.std().item() - loader.DUMMY_STD) < 2e-3
    assert torch.equal(w["model.norm.weight"], torch.ones(c.hidden_size))
    assert torch.equal(
        qkv, dict(again.model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
    )
    assert not torch.equal(
        qkv, dict(other.model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
    )


def test_llama_3_1_8b_config_and_rope_match_transformers():
    path = dummy_config_path("llama-3.1-8b")
    c = load_hf_config(path)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        32,
        4096,
        32,
        8,
        128,
    )
    assert c.vocab_size == 128256 and c.eos_token_ids == (128001, 128008, 128009)
    assert c.rope_scaling["rope_type"] == "llama3" and not c.tie_word_embeddings
    with open(path) as f:
        hf_config = transformers.LlamaConfig(**json.load(f))
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config=hf_config)
    torch.testing.assert_close(rope_inv_freq(c), hf_rope.inv_freq, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# GGUF Q/K permutation


@pytest.mark.parametrize("n_head", [1, 3, 8])
def test_reverse_permute_undoes_llama_cpp_permute(n_head):
    w = np.random.default_rng(0).standard_normal((n_head * 16, 24)).astype(np.float32)
    permuted = gguf_format.llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(gguf_format.reverse_permute(permuted, n_head), w)


def _interleaved_rope(x: np.ndarray, pos: int, base: float) -> np.ndarray:
    """llama.cpp's (GPT-J) RoPE on one head: rotate pairs (2i, 2i+1)."""
    d = x.shape[-1]
    theta = pos * base ** (-np.arange(0, d, 2) / d)
    a, b = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2], out[1::2] = (
        a * np.cos(theta) - b * np.sin(theta),
        a * np.sin(theta) + b * np.cos(theta),
    )
    return out


def _rotate_half_rope(x: np.ndarray, pos: int, base: float) -> np.ndarray:
    """HF's RoPE on one head: rotate pairs (i, i + d/2)."""
    d = x.shape[-1]
    theta = pos * base ** (-np.arange(0, d, 2) / d)
    a, b = x[: d // 2], x[d // 2 :]
    return np.concatenate(
        [a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta)]
    )


def test_unpermuted_weights_with_rotate_half_equal_llama_cpp_rope():
    """The direction matters, not just the round trip: our (unpermuted weights + rotate_half)
    gives the same attention scores as llama.cpp's (permuted weights + interleaved RoPE)."""
    rng = np.random.default_rng(1)
    n_head, head_dim, hidden = 2, 8, 12
    w_hf = rng.standard_normal((n_head * head_dim, hidden))
    w_gguf = gguf_format.llama_cpp_permute(w_hf, n_head)
    x, y = rng.standard_normal(hidden), rng.standard_normal(hidden)
    ours = gguf_format.reverse_permute(w_gguf, n_head)
    for h in range(n_head):
        rows = slice(h * head_dim, (h + 1) * head_dim)
        score_cpp = _interleaved_rope(w_gguf[rows] @ x, 5, 1e4) @ _interleaved_rope(
            w_gguf[rows] @ y, 2, 1e4
        )
        score_ours = _rotate_half_rope(ours[rows] @ x, 5, 1e4) @ _rotate_half_rope(
            ours[rows] @ y, 2, 1e4
        )
        assert score_ours == pytest.approx(score_cpp, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# a synthetic GGUF written the way llama.cpp's converter writes one

VOCAB = 64
END_OF_TURN = 5


def _tiny_hf_llama() -> transformers.LlamaForCausalLM:
    model = tiny_hf_model(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=128,
                          tie_word_embeddings=True)  # fmt: skip
    with torch.no_grad():
        # the GGUF stores the embedding as Q8_0: give HF the same dequantized values
        emb = model.model.embed_tokens.weight
        q8 = gguf.quants.quantize(emb.numpy(), gguf.GGMLQuantizationType.Q8_0)
        emb.copy_(torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)))
    return model


_HF_TO_GGUF = {v: k for k, v in gguf_format._LAYER_NAMES.items()}


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, *rest = hf_name.split(".")
    return f"blk.{layer}.{_HF_TO_GGUF['.'.join(rest[:-1])]}.{rest[-1]}"


def write_gguf(model: transformers.LlamaForCausalLM, path: str) -> None:
    c = model.config
    tokens = [f"<t{i}>" if i != END_OF_TURN else "<|im_end|>" for i in range(VOCAB)]
    w = gguf_writer(model, path, "llama", tokens)
    w.add_rope_freq_base(10000.0)
    w.add_chat_template("{{ message['content'] }}<|im_end|>")
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp omits output.weight
        arr = p.numpy().astype(np.float32)
        if ".q_proj." in name:
            arr = gguf_format.llama_cpp_permute(arr, c.num_attention_heads)
        elif ".k_proj." in name:
            arr = gguf_format.llama_cpp_permute(arr, c.num_key_value_heads)
        if name == "model.embed_tokens.weight":
            q8 = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(name), q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(name), arr)
    finish_gguf(w)


@pytest.fixture()
def synthetic_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv(loader.CACHE_ENV, str(tmp_path / "cache"))
    model = _tiny_hf_llama()
    path = str(tmp_path / "tiny.gguf")
    write_gguf(model, path)
    return path, model


def test_gguf_config_and_eos_from_metadata(synthetic_gguf):
    path, hf = synthetic_gguf
    c = gguf_format.config_from_gguf(gguf_format.open_gguf(path))
    assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llama",
        2,
        4,
        2,
        16,
    )
    assert c.tie_word_embeddings and c.max_position_embeddings == 128
    assert c.eos_token_ids == (2, END_OF_TURN)  # the chat template ends turns with <|im_end|>


def test_gguf_conversion_cache_hit_and_logits_match_hf(synthetic_gguf):
    path, hf = synthetic_gguf
    args = ServerArgs(model=path)
    first = loader.load_model(args, CPU, torch.float32)
    assert first.cache_hit is False and os.path.isfile(loader.gguf_cache_path(path))
    second = loader.load_model(args, CPU, torch.float32)
    assert second.cache_hit is True and second.config == first.config
    for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), name

    # a changed file (new mtime) is converted again
    os.utime(path, ns=(1, 1))
    assert loader.load_model(args, CPU, torch.float32).cache_hit is False

    runner = ModelRunner(
        args.replace(max_total_tokens=256, page_size=4, max_running_requests=2, device="cpu")
    )
    assert runner.ready_info().eos_token_ids == [2, END_OF_TURN]
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, VOCAB, 19)]
    req = m.ForwardReq(
        slot=0,
        input_ids=m.pack_ids(prompt),
        start_pos=0,
        new_pages=m.pack_ids(range(1, 6)),
        new_slot=True,
        sampling=m.SamplingParams(temperature=0.0),
        prompt_logprobs=True,
    )
    _, (logits,) = runner.forward_with_logits(m.ForwardBatch(step=1, reqs=[req]))
    assert_logits_close(logits, hf_logits(hf, prompt))


def test_unreadable_cache_is_rebuilt(synthetic_gguf):
    path, _ = synthetic_gguf
    cached = loader.gguf_cache_path(path)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    with open(cached, "wb") as f:
        f.write(b"not a safetensors file")
    assert loader.load_model(ServerArgs(model=path), CPU, torch.float32).cache_hit is False
    assert loader.load_model(ServerArgs(model=path), CPU, torch.float32).cache_hit is True
