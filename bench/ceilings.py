"""The machine's ceilings and the served model's shape, measured in a benchmark's own run.

- ``copy_TBps``: a device-to-device copy, bytes read + written per second (on the GPU, 2 GiB each
  way: far beyond L2; on the CPU, 256 MiB each way);
- ``matmul_TFLOPs``: a square matmul in the model's dtype on random data (8192^3 bf16 on the
  GPU; 2048^3 on the CPU, with the worker's thread count);
- ``shape``: the served model's :class:`bench.roofline.ModelShape` from the same flags the server
  is launched with (config only: no weights are loaded).

bench/serving.py runs this as a subprocess before it launches a server, so the probe's memory is
released before the server sizes its KV pool:

    python bench/ceilings.py --model llama-3.1-8b --server-args "--load-format dummy"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.roofline import ModelShape
from radix_runtime.config import ServerArgs, parse_server_args


def cuda_time_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median over `iters` of one call timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_time_ms(fn, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_TBps(device: torch.device, n: int | None = None) -> float:
    """Device-to-device copy: bytes read + written per second (TB/s)."""
    if n is None:
        n = 1 << 30 if device.type == "cuda" else 1 << 27  # bf16 / fp32 elements
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    src = torch.randn(n, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    timer = cuda_time_ms if device.type == "cuda" else wall_time_ms
    ms = timer(lambda: dst.copy_(src))
    return 2 * n * src.element_size() / (ms * 1e-3) / 1e12


def matmul_TFLOPs(device: torch.device, dtype: torch.dtype, n: int | None = None) -> float:
    """A square n^3 matmul on random data (TFLOP/s)."""
    if n is None:
        n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timer = cuda_time_ms if device.type == "cuda" else wall_time_ms
    ms = timer(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def device_ceilings(device: torch.device, dtype: torch.dtype) -> dict:
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "copy_TBps": copy_TBps(device),
        "matmul_TFLOPs": matmul_TFLOPs(device, dtype),
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        out["threads"] = torch.get_num_threads()
    return out


def model_config(args: ServerArgs):
    """The ModelConfig the worker would build for these flags, read without loading weights."""
    from radix_runtime.model_source import resolve_model
    from radix_runtime.worker.model_config import load_hf_config

    source = resolve_model(args.model, args.load_format, args.model_config)
    if source.kind == "gguf":
        from radix_runtime.worker import gguf_format

        return gguf_format.config_from_gguf(gguf_format.open_gguf(source.path))
    return load_hf_config(source.path)


def model_shape(args: ServerArgs, dtype: torch.dtype) -> ModelShape:
    """The roofline's view of the served model: weights in `dtype` (the worker's compute dtype:
    quantized CPU weight formats and FP8 weights are not modelled), KV in the pool's type."""
    from radix_runtime.worker.kv_pool import kv_storage_dtype

    c = model_config(args)
    kv_dtype = kv_storage_dtype(args.kv_cache_dtype, dtype)
    return ModelShape(
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        weight_bytes_per_param=torch.empty((), dtype=dtype).element_size(),
        kv_bytes_per_element=torch.empty((), dtype=kv_dtype).element_size(),
        layer_windows=c.layer_windows,
    )


def probe(model: str, server_args: str) -> dict:
    """Ceilings of the device the server would run on, in its dtype, and the model's shape."""
    from radix_runtime.worker.model_runner import cpu_threads, pick_device, pick_dtype

    args = parse_server_args(["--model", model, *shlex.split(server_args)])
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads())
    return {**device_ceilings(device, dtype), "shape": model_shape(args, dtype).to_dict()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--server-args", default="", help="the flags the server runs with")
    opts = p.parse_args(argv)
    print(json.dumps(probe(opts.model, opts.server_args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
