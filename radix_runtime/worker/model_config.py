"""The model shape the worker needs, read from a Hugging Face config.json or GGUF metadata.

One frozen dataclass for every Llama-family checkpoint, so the model code never looks at a
format-specific dict.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# HF architectures / model_type values that the Llama implementation covers.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # llama | mistral | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, and Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias (HF puts the bias on o_proj too)
    # {"rope_type": "llama3" | "linear" | "default", ...}; None for plain RoPE
    rope_scaling: dict[str, Any] | None = None
    # llama.cpp's rope_freqs tensor (per-frequency divisors, how GGUF stores Llama 3 scaling)
    rope_freq_factors: tuple[float, ...] | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        data = json.loads(text)
        for key in ("rope_freq_factors", "eos_token_ids"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the classic keys or transformers 5's `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or params)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("rope_theta", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear"):
        raise ValueError(f"rope scaling {rope_type!r} is not supported (llama3, linear are)")
    return theta, {"rope_type": rope_type, **scaling}


def _model_type(cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
        )
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    return model_type


def config_from_hf_dict(cfg: dict[str, Any], extra_eos: list[int] | None = None) -> ModelConfig:
    model_type = _model_type(cfg)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = _rope_from_hf(cfg)
    llama_bias = bool(cfg.get("attention_bias", False))
    eos = _as_id_list(cfg.get("eos_token_id")) + list(extra_eos or [])
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or llama_bias,
        o_bias=model_type != "qwen2" and llama_bias,
        rope_scaling=scaling,
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def load_hf_config(path: str) -> ModelConfig:
    """`path` is a config.json or a folder holding one (plus an optional generation_config.json)."""
    folder, config_file = (path, os.path.join(path, "config.json"))
    if os.path.isfile(path):
        folder, config_file = os.path.dirname(path), path
    with open(config_file) as f:
        cfg = json.load(f)
    extra_eos: list[int] = []
    gen_file = os.path.join(folder, "generation_config.json")
    if os.path.isdir(path) and os.path.isfile(gen_file):
        with open(gen_file) as f:
            extra_eos = _as_id_list(json.load(f).get("eos_token_id"))
    return config_from_hf_dict(cfg, extra_eos)
