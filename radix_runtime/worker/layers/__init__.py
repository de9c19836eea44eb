"""Layers the model families share: projections, norms, rotary embeddings, gated MLPs.

Each family file (models/llama.py, models/qwen3.py, models/gemma3.py) composes these; none
copies them.
"""

from radix_runtime.worker.layers.linear import (
    Embedding,
    Linear,
    RowParallelLinear,
    reduce_row_parallel,
)
from radix_runtime.worker.layers.mlp import GatedMLP
from radix_runtime.worker.layers.norms import GemmaRMSNorm, RMSNorm
from radix_runtime.worker.layers.rotary import RotaryEmbedding, apply_rope, rope_inv_freq

__all__ = [
    "Embedding",
    "GatedMLP",
    "GemmaRMSNorm",
    "Linear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "apply_rope",
    "reduce_row_parallel",
    "rope_inv_freq",
]
