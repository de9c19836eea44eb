"""Build the model and fill its weights from a GGUF file, a Hugging Face folder, or dummy values.

GGUF dequantization takes seconds, so the converted float32 tensors (HF names, Q/K already
unpermuted) and the parsed config are cached as one safetensors file under
``$RADIX_RUNTIME_CACHE`` (default ``~/.cache/radix_runtime``), keyed by the GGUF's path, size
and mtime: a second start reads that file instead of the GGUF.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from radix_runtime.config import ServerArgs
from radix_runtime.model_source import ModelSource, resolve_model
from radix_runtime.worker import cpu_quant, gguf_format, quant
from radix_runtime.worker.distributed import TPRank, shard_checkpoint, shard_config
from radix_runtime.worker.model_config import ModelConfig, UnsupportedModel, load_hf_config
from radix_runtime.worker.models.checkpoint import fuse_checkpoint
from radix_runtime.worker.models.llama import LlamaForCausalLM
from radix_runtime.worker.models.registry import build_model, model_class

logger = logging.getLogger(__name__)

CACHE_ENV = "RADIX_RUNTIME_CACHE"
# bump when the cached layout changes, so stale conversions are never read
CACHE_FORMAT_VERSION = 1
_CONFIG_KEY = "radix_runtime_config"
_FORMAT_KIND = {"gguf": "gguf", "safetensors": "hf", "dummy": "dummy"}
DUMMY_STD = 0.02


@dataclass
class LoadedModel:
    source: ModelSource
    config: ModelConfig
    model: LlamaForCausalLM
    load_s: float
    cache_hit: bool | None = None  # GGUF only: whether the converted cache was used
    # per layer (k_scale, v_scale) an FP8 checkpoint carries for an FP8 KV cache
    kv_scales: dict[int, tuple[float, float]] | None = None
    quantization: str = "none"  # the weights: none | fp8 | awq | gptq (worker/quant.py)
    dtype: torch.dtype = torch.float32  # of the activations (and the KV cache)
    weight_format: str = "float32"  # on the CPU: float32 | bfloat16 | int8 | int4


def load_model(
    args: ServerArgs,
    device: torch.device,
    dtype: torch.dtype,
    packed_int4: bool = False,
    tp: TPRank | None = None,
) -> LoadedModel:
    """`packed_int4`: int4 weights (an AWQ / GPTQ checkpoint, `--quantization int4`) stay packed
    in `quant.Int4Linear`s for the int4 GEMV, instead of dequantized at load. `tp`: build this
    rank's share of the model (from its local config, filled from the checkpoint's slices;
    `LoadedModel.config` is then the local config)."""
    tp = tp or TPRank()
    source = resolve_model(args.model, args.load_format, args.model_config)
    expected = _FORMAT_KIND.get(args.load_format)
    if expected is not None and source.kind != expected:
        raise ValueError(
            f"--load-format {args.load_format} does not fit {source.path} ({source.kind})"
        )
    t0 = time.perf_counter()
    cache_hit = None
    kv_scales: dict[int, list[float]] = {}
    quantization = "none"
    if source.kind == "dummy":
        config = load_hf_config(source.path)
        model = build_model(shard_config(config, tp.size), device, dtype)
        if tp.enabled:  # the full model's values (what --tp 1 draws), sliced
            full = dummy_weights(config, device, dtype, args.seed)
            model.load_weights(shard_checkpoint(full, config, tp.rank, tp.size))
        else:
            init_dummy_weights(model, args.seed)
    elif source.kind == "hf":
        config = load_hf_config(source.path)
        if tp.enabled and config.quantization is not None:
            raise UnsupportedModel("--tp > 1 does not load quantized checkpoints yet")
        model = build_model(shard_config(config, tp.size), device, dtype)
        files = safetensors_files(source.path)
        weights = _progress(iter_safetensors(files), "loading weights", _count_keys(files))
        weights = shard_checkpoint(weights, config, tp.rank, tp.size)
        scheme = config.quantization or {"method": "none"}
        if scheme["method"] != "none" and args.quantization not in ("none", scheme["method"]):
            raise UnsupportedModel(
                f"--quantization {args.quantization} on a checkpoint already quantized with "
                f"{scheme['method']}"
            )
        if scheme["method"] == "fp8":
            quant.use_fp8_layers(model, device)
            weights = quant.fp8_checkpoint(weights, kv_scales)
        elif scheme["method"] in ("awq", "gptq"):
            packed = packed_int4 and quant.use_int4_layers(model, device, scheme)
            weights = quant.int4_checkpoint(weights, scheme, dtype, kv_scales, packed)
            quantization = scheme["method"]
        model.load_weights(weights)
        quant.finish_int4_layers(model)
    elif source.kind == "gguf":
        config, weights, total, cache_hit = gguf_checkpoint(source.path)
        gguf_types = gguf_format.tensor_types(gguf_format.open_gguf(source.path))
        weight_format = resolve_cpu_weight_format(args, device, dtype, gguf_types)
        # quantized formats are fitted from the float32 dequantization (exact Q4 grids)
        build_dtype = torch.float32 if weight_format in ("int8", "int4") else dtype
        model = build_model(shard_config(config, tp.size), device, build_dtype)
        weights = shard_checkpoint(weights, config, tp.rank, tp.size)
        model.load_weights(_progress(weights, "loading weights", total))
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")
    if args.quantization == "fp8" and model.quantization == "none":
        quant.quantize_model_fp8(model)
    elif args.quantization == "int4" and quantization == "none":
        quant.quantize_model_int4_rtn(model, packed=packed_int4)
    if args.quantize_lm_head:
        if model.quantization == "none":
            raise UnsupportedModel(
                "--quantize-lm-head needs quantized weights (--quantization fp8 / int4, or an "
                "FP8 / AWQ / GPTQ checkpoint)"
            )
        quant.quantize_lm_head_fp8(model)
    if model.quantization != "none":
        quantization = model.quantization
    if source.kind != "gguf":
        gguf_types = {}
        weight_format = resolve_cpu_weight_format(args, device, dtype, gguf_types)
    if quantization != "none":  # --quantization / a quantized checkpoint: its own layers
        weight_format = "float32" if device.type == "cpu" else weight_format
    elif device.type == "cpu" and weight_format != "float32":
        model = to_cpu_weight_format(model, weight_format, gguf_types)
        dtype = torch.bfloat16 if weight_format == "bfloat16" else torch.float32
    load_s = time.perf_counter() - t0
    logger.info(
        "loaded %s (%s, weights %s, CPU format %s) in %.2fs",
        source.name, source.kind, quantization, weight_format, load_s,
    )  # fmt: skip
    scales = {i: (k, v) for i, (k, v) in kv_scales.items()} or None
    return LoadedModel(
        source, model.config, model, load_s, cache_hit, scales, quantization, dtype, weight_format
    )


def resolve_cpu_weight_format(
    args: ServerArgs, device: torch.device, dtype: torch.dtype, gguf_types: dict[str, str]
) -> str:
    """--cpu-weight-format with --dtype: `auto` follows an explicit --dtype, else the checkpoint
    (`cpu_quant.auto_format`); off the CPU the weights stay in `dtype` (its name is returned)."""
    fmt = args.cpu_weight_format
    if device.type != "cpu":
        if fmt != "auto":
            raise ValueError("--cpu-weight-format applies to the CPU; leave it at auto on CUDA")
        return str(dtype).removeprefix("torch.")
    if args.quantization != "none":  # worker/quant.py's layers, in --dtype
        return "float32"
    if fmt == "auto":
        if args.dtype != "auto":  # an explicit --dtype: dense weights in it
            return "bfloat16" if args.dtype == "bfloat16" else "float32"
        fmt = cpu_quant.auto_format(gguf_types)
    return fmt


def to_cpu_weight_format(
    model: LlamaForCausalLM, weight_format: str, gguf_types: dict[str, str]
) -> LlamaForCausalLM:
    """A float32 (or bf16) model -> bf16 weights and activations, or float32 activations with
    int8 / int4 projections (cpu_quant's kernels quantize each activation row themselves)."""
    if weight_format in ("int8", "int4"):
        cpu_quant.quantize_model(model.float(), weight_format, gguf_types)
        return model
    return model.to(torch.bfloat16)


def _progress(it: Iterable, desc: str, total: int | None) -> Iterable:
    return tqdm(it, desc=desc, total=total, unit="tensor", dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------
# dummy


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """normal(0, 0.02) matrices, unit norms, zero biases: in place on the target device and dtype.

    Norm weights are 1 (not random) so activations keep a sane scale through many layers,
    which keeps benchmark numerics free of inf/nan.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in _progress(list(model.named_parameters()), "dummy weights", None):
        _fill_dummy(name, p.data, gen)


def dummy_weights(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors `init_dummy_weights` puts in the full model, one at a time under their
    parameter names (a tensor-parallel rank keeps its slices of them)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        shapes = [(n, p.shape) for n, p in model_class(config)(config, dtype).named_parameters()]
    for name, shape in _progress(shapes, "dummy weights", None):
        yield name, _fill_dummy(name, torch.empty(shape, dtype=dtype, device=device), gen)


def _fill_dummy(name: str, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return t.fill_(1.0)
    if name.endswith(".bias"):
        return t.zero_()
    return t.normal_(0.0, DUMMY_STD, generator=gen)


# ---------------------------------------------------------------------------------------------
# Hugging Face folders


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{folder} has no model.safetensors or model.safetensors.index.json")


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, f.get_tensor(key)


def _count_keys(files: list[str]) -> int:
    total = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(f.keys())
    return total


# ---------------------------------------------------------------------------------------------
# GGUF with the conversion cache


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "radix_runtime"
    )


def gguf_cache_path(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|v{CACHE_FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache_dir(), "gguf", f"{stem}-{digest}.safetensors")


def gguf_checkpoint(
    path: str,
) -> tuple[ModelConfig, Iterable[tuple[str, torch.Tensor]], int, bool]:
    """(config, weights, tensor count, cache hit) for a GGUF file, converting it on a cache miss."""
    cached = gguf_cache_path(path)
    if os.path.isfile(cached):
        try:
            with safe_open(cached, framework="pt", device="cpu") as f:
                config = ModelConfig.from_json(f.metadata()[_CONFIG_KEY])
                total = len(f.keys())
            return config, iter_safetensors([cached]), total, True
        except Exception as exc:  # a truncated or foreign file: convert again
            logger.warning("ignoring the unreadable GGUF cache %s: %s", cached, exc)
    reader = gguf_format.open_gguf(path)
    config = gguf_format.config_from_gguf(reader)
    total = gguf_format.num_weight_tensors(reader)
    tensors = fuse_checkpoint(
        _progress(gguf_format.gguf_tensors(reader, config), "dequantizing GGUF", total)
    )
    _write_cache(cached, tensors, config)
    return config, tensors.items(), len(tensors), False


def _write_cache(path: str, tensors: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Atomic (temp file + rename), so a crash never leaves a half-written cache behind."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        os.close(fd)
        save_file(tensors, tmp, metadata={_CONFIG_KEY: config.to_json()})
        os.replace(tmp, path)
        logger.info("cached the converted GGUF at %s", path)
    except OSError as exc:  # a read-only or full disk must not stop the server
        logger.warning("could not write the GGUF cache %s: %s", path, exc)
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
