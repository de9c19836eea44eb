"""The gated MLP every supported family uses: down(act(gate(x)) * up(x)), gate and up fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radix_runtime.worker.layers.linear import Linear, RowParallelLinear


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF `hidden_act` / `hidden_activation` values -> the function
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
}


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        act: str = "silu",
        tp_size: int = 1,
    ) -> None:
        """`intermediate_size`: this rank's share with tensor parallelism (gate/up hold those
        rows, down those columns, its output summed over the `tp_size` ranks)."""
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden activation {act!r} is not supported ({sorted(ACTIVATIONS)})")
        self.act_name = act
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, dtype, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
