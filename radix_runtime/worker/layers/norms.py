"""RMSNorms: Llama's (x_hat * w, rounded to the input dtype before the multiply) and Gemma's
(x_hat * (1 + w), multiplied in float32, rounded once), each as Hugging Face computes it."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x), in float32."""
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm: the checkpoint stores w with the scale being (1 + w)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).to(x.dtype)
