"""The fused parameter layout every model family shares: q/k/v and gate/up are one parameter each.

Checkpoint tensors (Hugging Face names) map to (our parameter, shard); `shard_rows` says which rows
of the fused parameter a shard fills. Used by the models' `load_weights`, the GGUF conversion cache
(`fuse_checkpoint`) and the CPU weight formats.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radix_runtime.worker.model_config import ModelConfig

# checkpoint name part -> (our fused parameter part, shard id)
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def fused_name(name: str) -> tuple[str, str | int | None]:
    """Checkpoint name -> (our parameter name, shard id or None when it fills the whole parameter)."""
    for part, (fused, shard) in _STACKED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def shards_of(param_name: str) -> list[str | int | None]:
    if ".qkv_proj." in param_name:
        return ["q", "k", "v"]
    if ".gate_up_proj." in param_name:
        return [0, 1]
    return [None]


def shard_rows(config: ModelConfig, shard: str | int | None, total: int) -> slice:
    """The rows of a fused parameter that one checkpoint shard fills."""
    q, kv = config.q_size, config.kv_size
    if shard == "q":
        return slice(0, q)
    if shard == "k":
        return slice(q, q + kv)
    if shard == "v":
        return slice(q + kv, q + 2 * kv)
    if isinstance(shard, int):
        return slice(shard * config.intermediate_size, (shard + 1) * config.intermediate_size)
    return slice(0, total)


def fuse_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """HF-named tensors -> our parameter layout (q/k/v and gate/up concatenated), same dtype.

    Used for the GGUF conversion cache, so a cached load is a plain name-for-name assignment.
    """
    fused: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[str | int | None, torch.Tensor]] = {}
    for name, tensor in weights:
        target, shard = fused_name(name)
        if shard is None:
            fused[target] = tensor
        else:
            shards.setdefault(target, {})[shard] = tensor
    for target, parts in shards.items():
        fused[target] = torch.cat([parts[s] for s in shards_of(target)])
    return fused
