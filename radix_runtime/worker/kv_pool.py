"""The paged KV pool: per layer, K and V of shape [num_pages, page_size, kv_heads, head_dim].

Page 0 is reserved: the scheduler never hands it out, so backends may use it as padding.
A token's *cache location* is ``page * page_size + offset``: an index into the flat
[num_pages * page_size, kv_heads, head_dim] view of a layer's buffer.

The pool's element type (`dtype`) is the model's activation dtype (`act_dtype`), or FP8 e4m3
(`--kv-cache-dtype fp8_e4m3`): each layer's K and V then carry one float scale each
(`k_scales`/`v_scales`, from the checkpoint or 1.0): stored = clamp(x / scale) in FP8,
read = stored * scale. A tier that copies pages (a host pool) allocates the same `dtype` and
copies the bytes; the scales stay with the layers.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

CPU_POOL_MEMORY_FRACTION = 0.2  # of available RAM
CPU_POOL_MAX_TOKENS = 65536
# on CUDA, room left for activations, logits and CUDA graphs after the static fraction
CUDA_ACTIVATION_HEADROOM_BYTES = 2 << 30
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # the largest finite e4m3fn value; stores clamp to it (no inf in e4m3fn)


def kv_storage_dtype(kv_cache_dtype: str, act_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype -> the pool's element type."""
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_KV_DTYPE
    if kv_cache_dtype != "auto":
        raise ValueError(f"unknown kv cache dtype {kv_cache_dtype!r}")
    return act_dtype


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        act_dtype: torch.dtype | None = None,
        kv_scales: dict[int, tuple[float, float]] | None = None,
    ) -> None:
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is reserved)")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.act_dtype = dtype if act_dtype is None else act_dtype
        self.device = device
        # per layer (k_scale, v_scale); used only when the pool is FP8
        scales = kv_scales or {}
        self.k_scales = [float(scales.get(i, (1.0, 1.0))[0]) for i in range(num_layers)]
        self.v_scales = [float(scales.get(i, (1.0, 1.0))[1]) for i in range(num_layers)]
        shape = (num_pages, page_size, kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_KV_DTYPE

    @property
    def kv_cache_dtype(self) -> str:
        """The --kv-cache-dtype spelling of the element type (what /get_server_info reports)."""
        return "fp8_e4m3" if self.is_fp8 else str(self.dtype).removeprefix("torch.")

    @property
    def num_slots(self) -> int:
        """Token locations in the pool, page 0 included."""
        return self.num_pages * self.page_size

    def k_flat(self, layer_id: int) -> torch.Tensor:
        return self.k_buffers[layer_id].view(self.num_slots, self.kv_heads, self.head_dim)

    def v_flat(self, layer_id: int) -> torch.Tensor:
        return self.v_buffers[layer_id].view(self.num_slots, self.kv_heads, self.head_dim)

    def store(
        self, layer_id: int, cache_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write K/V of shape [n, kv_heads, head_dim] at the flat locations `cache_loc` [n]."""
        if self.is_fp8:
            k = quantize_fp8(k, self.k_scales[layer_id])
            v = quantize_fp8(v, self.v_scales[layer_id])
        self.k_flat(layer_id)[cache_loc] = k.to(self.dtype)
        self.v_flat(layer_id)[cache_loc] = v.to(self.dtype)

    def dequantize(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V rows read from this pool -> `act_dtype` values (FP8: times the layer's scales)."""
        if not self.is_fp8:
            return k.to(self.act_dtype), v.to(self.act_dtype)
        k = k.to(self.act_dtype) * self.k_scales[layer_id]
        return k, v.to(self.act_dtype) * self.v_scales[layer_id]

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in FP8 e4m3, clamped to the finite range (a plain cast turns overflow into NaN)."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def available_cpu_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); falls back to total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pool_tokens_from_memory(
    device: torch.device, bytes_per_token: int, mem_fraction_static: float
) -> int:
    """How many tokens of KV fit, when --max-total-tokens is not given.

    CPU: min(20% of available RAM, 64K tokens) — the CPU path serves a small model, and a
    larger pool only slows start-up. CUDA: like SGLang, everything free beyond
    (1 - mem_fraction_static) of the card (measured after the weights are loaded), minus a
    fixed headroom for activations.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1.0 - mem_fraction_static) - CUDA_ACTIVATION_HEADROOM_BYTES
        tokens = int(budget // bytes_per_token)
    else:
        budget = available_cpu_memory() * CPU_POOL_MEMORY_FRACTION
        tokens = min(int(budget // bytes_per_token), CPU_POOL_MAX_TOKENS)
    if tokens <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache on {device} (budget {budget / 2**30:.2f} GiB); "
            "lower --max-total-tokens or raise --mem-fraction-static"
        )
    return tokens


def num_pages_for(
    max_total_tokens: int | None,
    page_size: int,
    device: torch.device,
    bytes_per_token: int,
    mem_fraction_static: float,
) -> int:
    """Pages in the pool including the reserved page 0."""
    tokens = max_total_tokens
    if tokens is None:
        tokens = pool_tokens_from_memory(device, bytes_per_token, mem_fraction_static)
        logger.info("KV pool sized from memory: %d tokens", tokens)
    return max(tokens // page_size, 1) + 1
