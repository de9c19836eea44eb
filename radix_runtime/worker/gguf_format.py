"""GGUF checkpoints: metadata -> ModelConfig, tensors -> dequantized float32 with HF names.

llama.cpp's converter permutes the rows of Q and K of `llama`-architecture models so that its
interleaved (GPT-J style) RoPE equals HF's rotate_half RoPE. We run rotate_half, so the
permutation is undone here (`reverse_permute`, as transformers' GGUF integration does).
Qwen2, Qwen3 and Gemma 3 files use llama.cpp's NEOX RoPE and are stored unpermuted.

Gemma 3: llama.cpp stores every norm weight as (1 + w) (its RMSNorm multiplies by the weight);
we subtract the 1 back. The GGUF carries no layer pattern, local RoPE base or attention scale:
llama.cpp hard-codes them (every 6th layer global, base 10,000 for local layers, scale
(hidden / heads) ** -0.5 for the 62-layer 27B and head_dim ** -0.5 otherwise), and so do we.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radix_runtime.utils.gguf_header import read_gguf_metadata
from radix_runtime.worker.model_config import ModelConfig, UnsupportedModel

# architectures whose Q/K rows llama.cpp permuted on conversion
_PERMUTED_ARCHS = ("llama",)
# general.architecture -> (ModelConfig.model_type, the family in models/registry.py)
_ARCH_TO_MODEL_TYPE = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
}
_ARCH_FAMILY = {"qwen3": "qwen3", "gemma3": "gemma3"}
_GEMMA3_SWA_PATTERN = 6
_NORM_SHIFTED_ARCHS = ("gemma3",)
# end-of-turn markers that chat templates emit; when the template uses one, it also ends generation
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# per-architecture differences (Gemma's ffn_norm is the norm before the MLP, and it has two more)
_ARCH_LAYER_NAMES = {
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # folded into the config, not a model weight


@dataclass
class GgufFile:
    """A GGUF file: its key/value metadata (`utils/gguf_header.py`, the reader every GGUF consumer
    shares) and `gguf.GGUFReader`'s view of its tensors."""

    path: str
    meta: dict[str, Any]
    reader: Any  # gguf.GGUFReader

    @property
    def tensors(self) -> list:
        return self.reader.tensors


def open_gguf(path: str) -> GgufFile:
    from gguf import GGUFReader

    return GgufFile(path, read_gguf_metadata(path), GGUFReader(path))


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    raise KeyError(f"unexpected GGUF tensor {gguf_name!r}")


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head)`: rows go from interleaved pairs back to two halves.

    llama.cpp: ``w.reshape(n_head, 2, d // n_head // 2, ...).swapaxes(1, 2)``; this is its inverse.
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permutation (used by the round-trip test)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _eos_ids(meta: dict[str, Any]) -> list[int]:
    ids = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    template = meta.get("tokenizer.chat_template") or ""
    used = [t for t in _END_OF_TURN_TOKENS if t in template]
    if used:
        vocab = {tok: i for i, tok in enumerate(meta.get("tokenizer.ggml.tokens") or [])}
        ids += [vocab.get(t) for t in used]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _tensor_by_name(f: GgufFile, name: str):
    return next((t for t in f.tensors if t.name == name), None)


def gguf_architecture(meta: dict[str, Any]) -> str:
    """The file's `general.architecture`, after the refusals its header alone decides (an
    architecture we do not implement, MoE, a RoPE scaling type we do not implement). The CLI's
    preflight runs these on the header before any process starts; the worker again on load."""
    arch = meta.get("general.architecture")
    if arch not in _ARCH_TO_MODEL_TYPE:
        raise UnsupportedModel(
            f"GGUF general.architecture = {arch!r} is not supported "
            f"({', '.join(_ARCH_TO_MODEL_TYPE)} are)"
        )
    if meta.get(f"{arch}.expert_count"):
        raise UnsupportedModel(f"GGUF {arch}.expert_count = {meta[f'{arch}.expert_count']}: MoE")
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear", "yarn"):
        raise UnsupportedModel(
            f"GGUF {arch}.rope.scaling.type = {kind!r} is not supported (linear, yarn are)"
        )
    return arch


def config_from_gguf(f: GgufFile) -> ModelConfig:
    arch = gguf_architecture(f.meta)

    def get(key: str, default=None):
        return f.meta.get(f"{arch}.{key}", default)

    names = {t.name for t in f.tensors}
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    embed = _tensor_by_name(f, "token_embd.weight")
    scaling = _gguf_rope_scaling(get)
    freqs = _tensor_by_name(f, ROPE_FREQS)
    num_layers = int(get("block_count"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    family = _ARCH_FAMILY.get(arch, "llama")
    extra: dict = {}
    if family == "gemma3":
        window = int(get("attention.sliding_window"))
        extra = {
            "layer_windows": tuple(
                0 if (i + 1) % _GEMMA3_SWA_PATTERN == 0 else window for i in range(num_layers)
            ),
            "attn_scale": (hidden // heads if num_layers == 62 else head_dim) ** -0.5,
            "rope_local_theta": 10000.0,
            "hidden_act": "gelu_pytorch_tanh",
        }
    elif get("attention.sliding_window"):
        raise UnsupportedModel(f"GGUF {arch}.attention.sliding_window on a {arch} model")
    return ModelConfig(
        architecture=family,
        qk_norm=family != "llama",
        **extra,
        model_type=_ARCH_TO_MODEL_TYPE[arch],
        vocab_size=int(get("vocab_size") or int(embed.shape[1])),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        rope_scaling=scaling,
        rope_freq_factors=None if freqs is None else tuple(float(x) for x in freqs.data),
        eos_token_ids=tuple(_eos_ids(f.meta)),
    )


def _gguf_rope_scaling(get) -> dict | None:
    """llama.cpp's rope.scaling.* keys -> our scaling dict (`gguf_architecture` refused every
    type but linear and yarn)."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(get("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
    }


def dequantize_tensor(t) -> np.ndarray:
    """A GGUF tensor as float32 in PyTorch's [out, in] order (GGUF lists dims innermost first)."""
    from gguf import quants

    values = quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape))
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    # F32 tensors come back as views of the read-only memory map: torch wants its own copy
    return values if values.flags.writeable else values.copy()


def gguf_tensors(f: GgufFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight, Q/K unpermuted where llama.cpp permuted them."""
    arch = f.meta["general.architecture"]
    permuted = arch in _PERMUTED_ARCHS
    for t in f.tensors:
        if t.name == ROPE_FREQS:
            continue
        values = dequantize_tensor(t)
        if arch in _NORM_SHIFTED_ARCHS and t.name.endswith("norm.weight"):
            values = values - 1.0
        if permuted and ".attn_q." in t.name:
            values = reverse_permute(values, config.num_heads)
        elif permuted and ".attn_k." in t.name:
            values = reverse_permute(values, config.num_kv_heads)
        yield hf_tensor_name(t.name, arch), torch.from_numpy(values)


def num_weight_tensors(f: GgufFile) -> int:
    return sum(1 for t in f.tensors if t.name != ROPE_FREQS)


def tensor_types(f: GgufFile) -> dict[str, str]:
    """HF name -> GGUF tensor type name (`Q4_1`, `Q8_0`, `F32`, ...) of every weight."""
    arch = f.meta["general.architecture"]  # Gemma 3 names its norms its own way
    return {
        hf_tensor_name(t.name, arch): t.tensor_type.name for t in f.tensors if t.name != ROPE_FREQS
    }
