"""Allocation-only projection and embedding modules (the loader fills them).

Tensor parallelism (worker/distributed.py) needs one layer of its own: a row-parallel
projection (o_proj, down_proj: each rank holds some input columns) whose partial outputs are
summed over the ranks. Column-parallel projections (qkv_proj, gate_up_proj: each rank holds some
output rows) are plain `Linear`s built with the rank's local shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). Allocation only: torch's nn.Linear would run an init we overwrite anyway."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A projection over this rank's share of the input features, all-reduced over the
    `tp_size` ranks (a plain Linear when tp_size is 1). A bias is added once: the loader zeroes
    it on every rank but the first."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, tp_size: int = 1
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(super().forward(x))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Sum this rank's partial output with the others' (in place)."""
        if self.tp_size == 1:
            return y
        from radix_runtime.worker.distributed import all_reduce

        return all_reduce(y)


def reduce_row_parallel(layer: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """For the fused paths, which run a projection's matmul themselves (`project(x, layer)`):
    a row-parallel layer's all-reduce; any other layer's output as it is."""
    return layer.reduce(y) if isinstance(layer, RowParallelLinear) else y


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
