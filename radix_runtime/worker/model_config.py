"""The model shape the worker needs, read from a Hugging Face config.json or GGUF metadata.

One frozen dataclass for every supported family (models/registry.py maps its `architecture` to
the model class), so the model code never looks at a format-specific dict. Everything a config
asks for that we do not implement is refused here, at load, with the field named
(`UnsupportedModel`): a model is never served with a feature silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

# RoPE scaling types layers/rotary.py implements
IMPLEMENTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# HF `architectures[0]` (or `model_type` when a config has no architectures) -> (our family,
# the model_type it is read as). The family picks the model class (models/registry.py).
HF_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("llama", "mistral"),
    "Qwen2ForCausalLM": ("llama", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
    "Gemma3ForCausalLM": ("gemma3", "gemma3_text"),
    # the multimodal checkpoint: its language model only (the vision tower's weights are skipped)
    "Gemma3ForConditionalGeneration": ("gemma3", "gemma3_text"),
}
_MODEL_TYPES = {
    "llama": ("llama", "llama"),
    "mistral": ("llama", "mistral"),
    "qwen2": ("llama", "qwen2"),
    "qwen3": ("qwen3", "qwen3"),
    "gemma3_text": ("gemma3", "gemma3_text"),
    "gemma3": ("gemma3", "gemma3_text"),
}
# model types kept for callers that list what the Llama implementation covers
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# rope types transformers knows that we refuse, with the reason
_REFUSED_ROPE = {
    "dynamic": "its frequencies change with the length of the sequence being computed, so K "
    "cached at one length would not match a recomputation at another (no paged cache can "
    "hold it)",
    "longrope": "not implemented (Phi-3 long-context scaling)",
}


# Gemma3TextConfig's defaults (transformers), for the fields a config.json may leave out
_GEMMA3_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
}


class UnsupportedModel(ValueError):
    """A checkpoint whose architecture or configuration we do not implement."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # llama | mistral | qwen2 | qwen3 | gemma3_text
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
    # {"rope_type": "llama3" | "linear" | "yarn", ...}; None for plain RoPE (global layers)
    rope_scaling: dict[str, Any] | None = None
    # llama.cpp's rope_freqs tensor (per-frequency divisors, how GGUF stores Llama 3 scaling)
    rope_freq_factors: tuple[float, ...] | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # the model class (models/registry.py): llama | qwen3 | gemma3
    architecture: str = "llama"
    # per layer, how many keys (itself included) a query sees: 0 = all (HF's `sliding_window`:
    # query at position p attends to keys at positions > p - window); None = no windowed layer
    layer_windows: tuple[int, ...] | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
    hidden_act: str = "silu"
    # the softmax scale; None = head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    attn_scale: float | None = None
    final_logit_softcapping: float | None = None  # logits -> tanh(logits / c) * c
    # Gemma 3's local (sliding) layers: their own RoPE base, and scaling (None = plain)
    rope_local_theta: float | None = None
    rope_local_scaling: dict[str, Any] | None = None
    # the checkpoint's weight quantization (model_config.quant_scheme): None = unquantized
    quantization: dict[str, Any] | None = None
    # tensor parallelism: > 1 in a rank's local view (worker/distributed.py `shard_config`), whose
    # heads, KV heads and intermediate size are that rank's share; the row-parallel projections
    # (o_proj, down_proj) all-reduce their output over the ranks
    tp_size: int = 1

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    @property
    def sliding_window(self) -> int:
        """The largest window of any layer (0 when every layer sees everything)."""
        return max(self.layer_windows or (0,))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        data = json.loads(text)
        for key in ("rope_freq_factors", "eos_token_ids", "layer_windows"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def check_rope(rope_type: str, where: str) -> None:
    """Refuse a rope type we do not implement, naming the config field it came from."""
    if rope_type in IMPLEMENTED_ROPE_TYPES:
        return
    why = _REFUSED_ROPE.get(rope_type, "unknown")
    raise UnsupportedModel(
        f"{where} = {rope_type!r} is not supported ({why}); "
        f"implemented: {', '.join(IMPLEMENTED_ROPE_TYPES)}"
    )


def _scaling(params: dict[str, Any], where: str) -> tuple[float | None, dict[str, Any] | None]:
    """(theta or None, scaling or None) from one rope dict (`rope_scaling` or `rope_parameters`)."""
    scaling = dict(params)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    theta = scaling.pop("rope_theta", None)
    check_rope(rope_type, f"{where}.rope_type")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel(f"{where}.partial_rotary_factor < 1 is not supported")
    return (None if theta is None else float(theta)), (
        None if rope_type == "default" else {"rope_type": rope_type, **scaling}
    )


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the classic keys or transformers 5's `rope_parameters`."""
    if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel("partial_rotary_factor < 1 is not supported")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # per layer type (Gemma 3 in transformers 5)
        params = params["full_attention"]
    where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    theta, scaling = _scaling(cfg.get("rope_scaling") or params, where)
    if theta is None:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return theta, scaling


def resolve_architecture(cfg: dict[str, Any]) -> tuple[str, str]:
    """(family, model_type) for a config.json, or UnsupportedModel naming what we lack."""
    archs = cfg.get("architectures") or []
    for name in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"):
        if cfg.get(name):
            raise UnsupportedModel(
                f"{name} = {cfg[name]!r}: mixture-of-experts models are not supported "
                f"(architecture {archs[0] if archs else cfg.get('model_type')!r})"
            )
    if archs:
        if archs[0] not in HF_ARCHITECTURES:
            raise UnsupportedModel(
                f"architectures = {archs!r} is not supported; supported: "
                f"{', '.join(HF_ARCHITECTURES)}"
            )
        return HF_ARCHITECTURES[archs[0]]
    model_type = cfg.get("model_type", "llama")
    if model_type not in _MODEL_TYPES:
        raise UnsupportedModel(
            f"model_type = {model_type!r} is not supported; supported: {', '.join(_MODEL_TYPES)}"
        )
    return _MODEL_TYPES[model_type]


def _layer_windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int, ...] | None:
    """Per-layer windows, as transformers decides them for each model type."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if model_type == "llama" and window:
        raise UnsupportedModel(
            f"sliding_window = {window} on a model_type 'llama' config: transformers ignores it "
            "there (full attention) while the checkpoint may expect a window; use model_type "
            "'mistral' for windowed attention, or remove the field"
        )
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window"):
            return None
        if types is None:  # transformers: sliding from layer max_window_layers on
            first = int(cfg.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]  # fmt: skip
    if model_type == "gemma3_text" and types is None:
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]  # fmt: skip
    if model_type == "mistral" and types is None and window:
        types = ["sliding_attention"] * num_layers
    if types is None:
        return None
    if len(types) != num_layers:
        raise UnsupportedModel(f"layer_types has {len(types)} entries for {num_layers} layers")
    out = []
    for t in types:
        if t == "full_attention":
            out.append(0)
        elif t == "sliding_attention" and window:
            out.append(int(window))
        elif t == "sliding_attention":
            out.append(0)  # transformers: sliding_window None means no window
        else:
            raise UnsupportedModel(f"layer_types entry {t!r} is not supported")
    return tuple(out) if any(out) else None


def _check_common(cfg: dict[str, Any]) -> None:
    if cfg.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias = true is not supported")
    if cfg.get("quantization_config"):
        quant_scheme(cfg["quantization_config"])


# quant_method values we load (worker/quant.py); anything else is refused by name
SUPPORTED_QUANT_METHODS = ("fp8", "compressed-tensors (FP8)", "awq", "gptq")


def _refuse_quant(what: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"quantization_config: {what} is not supported (supported: "
        f"{', '.join(SUPPORTED_QUANT_METHODS)}; docs/quantization.md)"
    )


def quant_scheme(q: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's `quantization_config` -> {"method": fp8 | awq | gptq, ...}, or
    UnsupportedModel naming the field we do not implement."""
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("weight_block_size"):
            raise _refuse_quant(
                f"fp8 weight_block_size = {q['weight_block_size']!r} (block-wise FP8)"
            )
        if q.get("fmt", "e4m3") != "e4m3":
            raise _refuse_quant(f"fp8 fmt = {q['fmt']!r}")
        if q.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise _refuse_quant(f"fp8 activation_scheme = {q['activation_scheme']!r}")
        _only_lm_head(q.get("modules_to_not_convert") or q.get("ignored_layers"), "fp8")
        return {"method": "fp8"}
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "awq":
        bits, group = q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size"))
        version = str(q.get("version", "gemm")).lower()
        if bits != 4:
            raise _refuse_quant(f"awq bits = {bits!r} (4 is)")
        if version != "gemm":
            raise _refuse_quant(f"awq version = {q.get('version')!r} (the GEMM layout is)")
        if not q.get("zero_point", True):
            raise _refuse_quant("awq zero_point = false")
        if not isinstance(group, int) or group <= 0:
            raise _refuse_quant(f"awq group_size = {group!r}")
        _only_lm_head(q.get("modules_to_not_convert"), "awq")
        return {"method": "awq", "group_size": group}
    if method == "gptq":
        bits, group = q.get("bits"), q.get("group_size", 128)
        if bits != 4:
            raise _refuse_quant(f"gptq bits = {bits!r} (4 is)")
        if q.get("desc_act"):
            raise _refuse_quant(
                "gptq desc_act = true (activation-order groups: g_idx reorders the input rows)"
            )
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse_quant(f"gptq checkpoint_format = {fmt!r}")
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise _refuse_quant(f"gptq group_size = {group!r}")
        return {"method": "gptq", "group_size": group, "zero_offset": 1 if fmt == "gptq" else 0}
    raise _refuse_quant(f"quant_method = {method!r}")


def _only_lm_head(modules: Any, where: str) -> None:
    extra = [x for x in (modules or []) if x != "lm_head"]
    if extra:
        raise _refuse_quant(f"{where} unquantized modules {extra[:4]!r} (only lm_head may be)")


def _compressed_tensors(q: dict[str, Any]) -> dict[str, Any]:
    """compressed-tensors as llm-compressor writes FP8 (W8A8 float, per tensor or channel)."""
    groups = q.get("config_groups") or {}
    fmt = q.get("format")
    if len(groups) != 1:
        raise _refuse_quant(f"compressed-tensors with {len(groups)} config_groups (one is)")
    group = next(iter(groups.values()))
    w = group.get("weights") or {}
    a = group.get("input_activations")
    desc = f"compressed-tensors weights num_bits {w.get('num_bits')} type {w.get('type')!r} "         f"strategy {w.get('strategy')!r} (format {fmt!r})"  # fmt: skip
    if not (
        w.get("num_bits") == 8
        and w.get("type") == "float"
        and w.get("strategy") in ("tensor", "channel")
        and w.get("symmetric", True)
        and fmt in ("float-quantized", "naive-quantized", None)
    ):
        raise _refuse_quant(desc)
    if a is not None and not (a.get("num_bits") == 8 and a.get("type") == "float"):
        raise _refuse_quant(
            f"compressed-tensors input_activations num_bits {a.get('num_bits')} "
            f"type {a.get('type')!r}"
        )
    if group.get("output_activations"):
        raise _refuse_quant("compressed-tensors output_activations")
    if group.get("targets", ["Linear"]) != ["Linear"]:
        raise _refuse_quant(f"compressed-tensors targets {group.get('targets')!r}")
    _only_lm_head(q.get("ignore"), "compressed-tensors")
    if "lm_head" not in (q.get("ignore") or []):
        raise _refuse_quant("compressed-tensors with a quantized lm_head (`ignore` lacks lm_head)")
    kv = q.get("kv_cache_scheme")
    if kv is not None and not (kv.get("num_bits") == 8 and kv.get("type") == "float"):
        raise _refuse_quant(f"compressed-tensors kv_cache_scheme {kv!r}")
    return {"method": "fp8"}


def config_from_hf_dict(cfg: dict[str, Any], extra_eos: list[int] | None = None) -> ModelConfig:
    family, model_type = resolve_architecture(cfg)
    eos = _as_id_list(cfg.get("eos_token_id"))
    qcfg = cfg.get("quantization_config")  # top level, also for a multimodal wrapper
    if qcfg:
        quant_scheme(qcfg)
    if family == "gemma3" and "text_config" in cfg:  # the multimodal wrapper: its text model
        eos = eos or _as_id_list(cfg["text_config"].get("eos_token_id"))
        cfg = {"model_type": "gemma3_text", **cfg["text_config"]}
    if family == "gemma3":  # released text_configs leave some fields at transformers' defaults
        cfg = {**_GEMMA3_DEFAULTS, **cfg}
    _check_common(cfg)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    num_layers = int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    theta, scaling = _rope_from_hf(cfg)
    llama_bias = bool(cfg.get("attention_bias", False))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    extra: dict[str, Any] = {}
    if family == "gemma3":
        extra = _gemma3_fields(cfg)
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModel(f"hidden_activation = {act!r} is not supported for Gemma 3")
    elif act not in ("silu", "swish"):
        raise UnsupportedModel(f"hidden_act = {act!r} is not supported (silu is)")
    if family == "qwen3" and llama_bias:
        raise UnsupportedModel("attention_bias = true is not supported for Qwen3")
    eos += list(extra_eos or [])
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
        qkv_bias=model_type == "qwen2" or llama_bias,
        o_bias=model_type != "qwen2" and llama_bias,
        rope_scaling=scaling,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        architecture=family,
        layer_windows=_layer_windows(cfg, model_type, num_layers),
        qk_norm=family in ("qwen3", "gemma3"),
        hidden_act="gelu_pytorch_tanh" if family == "gemma3" else "silu",
        quantization=quant_scheme(qcfg) if qcfg else None,
        **extra,
    )


def _gemma3_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModel(
            "use_bidirectional_attention = true (an embedding model) is not supported"
        )
    params = cfg.get("rope_parameters") or {}
    local_theta, local_scaling = _scaling(
        params.get("sliding_attention") or {}, "rope_parameters.sliding_attention"
    )
    if local_theta is None:
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))

    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModel(
            "attn_logit_softcapping is set: transformers' Gemma 3 does not apply it (the released "
            "Gemma 3 configs have null), so there is no reference to match; not supported"
        )
    if not cfg.get("sliding_window"):
        raise UnsupportedModel("sliding_window is missing or null on a Gemma 3 config")

    def cap(name: str) -> float | None:
        v = cfg.get(name)
        return None if v is None else float(v)

    return {
        "attn_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        "final_logit_softcapping": cap("final_logit_softcapping"),
        "rope_local_theta": local_theta,
        "rope_local_scaling": local_scaling,
    }


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


def preflight(source) -> None:
    """Refuse an unsupported model before any process starts: parse its config (HF folder or
    dummy config.json), or check a GGUF's architecture and RoPE keys from its header (the
    worker's full parse repeats these). Raises UnsupportedModel naming the field."""
    if source.kind in ("hf", "dummy"):
        load_hf_config(source.path)
        return
    if source.kind != "gguf":
        return
    from radix_runtime.utils.gguf_header import read_gguf_metadata
    from radix_runtime.worker.gguf_format import gguf_architecture

    gguf_architecture(read_gguf_metadata(source.path))
