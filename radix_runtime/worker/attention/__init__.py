"""Attention backends behind one interface (see base.py)."""

from __future__ import annotations

import importlib.util
import logging

import torch

from radix_runtime.worker.attention.base import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


def resolve_backend_name(name: str, device: torch.device) -> str:
    """auto: flashinfer on CUDA when both the package and our wrapper module exist, else torch."""
    if name != "auto":
        return name
    if device.type == "cuda" and _flashinfer_available():
        return "flashinfer"
    return "torch"


def _flashinfer_available() -> bool:
    return (
        importlib.util.find_spec("flashinfer") is not None
        and importlib.util.find_spec("radix_runtime.worker.attention.flashinfer_backend")
        is not None
    )


def create_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    **options,
) -> AttentionBackend:
    """`options`: scale, layer_windows (AttentionBackend's keyword arguments)."""
    name = resolve_backend_name(name, device)
    if name == "torch":
        from radix_runtime.worker.attention.torch_native import TorchNativeBackend

        cls: type[AttentionBackend] = TorchNativeBackend
    elif name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("--attention-backend flashinfer needs a CUDA device")
        from radix_runtime.worker.attention.flashinfer_backend import FlashInferBackend

        cls = FlashInferBackend
    else:
        raise ValueError(f"unknown attention backend {name!r}")
    logger.info("attention backend: %s", name)
    return cls(num_heads, num_kv_heads, head_dim, device, **options)


__all__ = ["AttentionBackend", "AttentionMetadata", "create_backend", "resolve_backend_name"]
