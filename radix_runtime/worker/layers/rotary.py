"""Rotary position embeddings (rotate-half convention) with the scaling types we implement.

Scaling types (the HF `rope_type`), each computed as transformers' `modeling_rope_utils` does:
- `default`: plain RoPE;
- `linear`: every frequency divided by `factor`;
- `llama3`: Llama 3.1's frequency-dependent divisor (or GGUF's precomputed `rope_freqs` divisors);
- `yarn`: NTK-by-parts interpolation plus an attention factor that scales cos and sin.
`dynamic` is refused at load (model_config.py): its frequencies depend on the length of the
sequence being computed, so K cached at one length would be rotated differently from a
recomputation at another; no paged cache can hold that consistently.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from radix_runtime.worker.model_config import IMPLEMENTED_ROPE_TYPES


def rope_parameters(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    freq_factors: tuple[float, ...] | None = None,
    max_position_embeddings: int | None = None,
) -> tuple[torch.Tensor, float]:
    """([head_dim / 2] float32 inverse frequencies, attention factor applied to cos and sin).
    Always on the CPU (models are built under torch.device("meta"))."""
    with torch.device("cpu"):
        return _rope_parameters(head_dim, theta, scaling, freq_factors, max_position_embeddings)


def _rope_parameters(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    freq_factors: tuple[float, ...] | None,
    max_position_embeddings: int | None,
) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    )
    if freq_factors is not None:  # GGUF's precomputed Llama 3 divisors
        return inv_freq / torch.tensor(freq_factors, dtype=torch.float32, device="cpu"), 1.0
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"rope_type {rope_type!r} is not implemented ({IMPLEMENTED_ROPE_TYPES})")


def rope_inv_freq(config) -> torch.Tensor:
    """A ModelConfig's global-layer inverse frequencies."""
    return rope_parameters(
        config.head_dim,
        config.rope_theta,
        config.rope_scaling,
        config.rope_freq_factors,
        config.max_position_embeddings,
    )[0]


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (same formula as transformers' rope utils)."""
    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(
    dim: int, base: float, s: dict, max_position_embeddings: int | None
) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`, partial_rotary_factor 1)."""
    original = float(s["original_max_position_embeddings"])
    factor = s.get("factor")
    if factor is None:
        factor = float(max_position_embeddings) / original
    factor = float(factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each frequency left unscaled
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding:
    """cos/sin for the positions of a batch, computed on the fly (no max-length table).

    `RotaryEmbedding(config)` gives a config's global layers; `theta` / `scaling` override them
    (Gemma 3's local layers: their own base frequency, no scaling)."""

    def __init__(self, config, theta: float | None = None, scaling: Any = "config") -> None:
        local = theta is not None or scaling != "config"
        self._inv_freq_cpu, self.attention_factor = rope_parameters(
            config.head_dim,
            config.rope_theta if theta is None else theta,
            config.rope_scaling if scaling == "config" else scaling,
            None if local else config.rope_freq_factors,
            config.max_position_embeddings,
        )
        self._inv_freq: torch.Tensor | None = None

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each [N, 1, head_dim], broadcasting over heads."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq_cpu.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
