"""Weight formats of the CPU path: float32, bfloat16, and weight-only int8 / int4 linears.

The quantized linears run torch's CPU weight-only kernels (the ones gpt-fast uses) on bfloat16
activations; neither has a fast path for float32 activations:

- ``int8``: `aten._weight_int8pack_mm`, one int8 row per output channel with a bf16 scale
  (symmetric, per channel).
- ``int4``: `aten._weight_int4pack_mm_for_cpu`, groups of 32 input columns with a bf16 scale and
  zero each: ``w = (q - 8) * scale + zero``, q in [0, 15].

A GGUF file's 4-bit groups map onto the int4 layout without a new rounding of the weights: Q4_1
(``w = d * q + m``) keeps its grid with an asymmetric min/max fit of each group (its quantizer puts
the group's min at q = 0 and max at q = 15), Q4_0 (``w = d * (q - 8)``) with a symmetric fit (its
largest magnitude sits at q = 0). Only the bf16 rounding of scale and zero is new. Every other
source (Q8_0, K-quants, F16/F32, safetensors) is requantized from the dequantized float32 values:
per-channel int8, or min/max int4 groups of 32 (K-quants' 6-bit sub-block scales do not always
span q = 0..15, so their 4-bit groups are refitted, at most half a step off).

The tied embedding stays a bf16 table for the lookup; its use as the LM head becomes a separate
quantized linear. In the int4 format a GGUF matrix stored at more than 4 bits (the default model's
Q8_0 embedding) stays int8: int4 never makes a weight coarser than the file's. docs/decisions.md ("CPU weight formats") has the measurements behind `auto`.
"""

from __future__ import annotations

import torch
from torch import nn

CPU_WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4")
INT4_GROUP = 32
# GGUF tensor types whose 4-bit grid the int4 layout holds as it is (see the module docstring)
GGUF_INT4_EXACT = {"Q4_0": "symmetric", "Q4_1": "asymmetric"}
# GGUF types that are 4-bit (or less) already: int4 adds no precision loss worth keeping 8 bits for
GGUF_4BIT = {"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"}


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], bf16 scales [N]): symmetric per output channel."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16)


def int4_groups(w: torch.Tensor, fit: str = "asymmetric") -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int32 [N, K] in [0, 15], scales_and_zeros float32 [K/32, N, 2]).

    `asymmetric`: scale = (max - min) / 15, q = round((w - min) / scale) (Q4_1's quantizer);
    `symmetric`: scale = -(the group's value of largest magnitude) / 8, q = round(w / scale) + 8
    (Q4_0's). Either way w ~= (q - 8) * scale + zero."""
    n, k = w.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs input features divisible by {INT4_GROUP}, got {k}")
    g = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    if fit == "symmetric":
        idx = g.abs().argmax(dim=-1, keepdim=True)
        scale = -g.gather(-1, idx) / 8.0
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(g / scale) + 8
        zero = torch.zeros_like(scale)
    else:
        lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((g - lo) / scale)
        zero = lo + 8.0 * scale
    q = q.clamp(0, 15).to(torch.int32).reshape(n, k)
    sz = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
    return q, sz


def dequantize_int4(q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """The float32 weights an `int4_groups` result stands for (tests, accuracy reports)."""
    n, k = q.shape
    scale = sz[..., 0].transpose(0, 1).repeat_interleave(INT4_GROUP, dim=1)
    zero = sz[..., 1].transpose(0, 1).repeat_interleave(INT4_GROUP, dim=1)
    return (q.float() - 8) * scale + zero


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous bf16 [rows, features] matrix. NOTE: the int4 kernel reads its input as
    dense rows whatever its strides say (a view with a row stride wider than its width, as the
    attention output of a q sliced from the qkv projection is, gave wrong products)."""
    return x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        q, scale = quantize_int8(weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scale)
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(_rows(x), self.weight_int8, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fit: str) -> None:
        super().__init__()
        q, sz = int4_groups(weight, fit)
        self.register_buffer(
            "weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        )
        sz_bf16 = sz.to(torch.bfloat16)
        self.register_buffer("scales_and_zeros", sz_bf16)
        # NOTE: the kernel takes bf16 zeros; their rounding error is the same for all 32 weights of
        # a group, so it adds (error x the group's input sum) to every product: with the large
        # activations of a few channels that drifted the default model's answer. The float32
        # residual [K/32, N] puts it back as one small matmul of the group sums (a plain attribute:
        # the model's .to(bfloat16) must not round it too).
        self.zero_residual = (sz[..., 1] - sz_bf16[..., 1].float()).contiguous()
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = _rows(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.weight_int4, INT4_GROUP, self.scales_and_zeros
        )
        group_sums = rows.view(rows.shape[0], -1, INT4_GROUP).sum(-1, dtype=torch.float32)
        # added in float32 and rounded once, in place: the same bits as y.float() + ... -> bf16
        y.add_(torch.mm(group_sums, self.zero_residual))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def int4_fit(gguf_types: dict[str, str], param: str) -> str:
    """The int4 fit of one of our parameters from the GGUF types of the tensors it was made of
    (a fused parameter keeps an exact fit only when all its parts share it)."""
    fits = {GGUF_INT4_EXACT.get(t) for t in _parts(gguf_types, param)}
    return fits.pop() if len(fits) == 1 and None not in fits else "asymmetric"


def _parts(gguf_types: dict[str, str], param: str) -> list[str]:
    """GGUF types of the checkpoint tensors behind our parameter `param` (HF-named keys)."""
    from radix_runtime.worker.models.checkpoint import fused_name

    return [t for name, t in gguf_types.items() if fused_name(name)[0] == param]


def _int4_keeps(gguf_types: dict[str, str], param: str) -> bool:
    """Whether int4 keeps this parameter's precision: GGUF matrices stored at more than 4 bits
    (the default model's Q8_0 embedding, used as its LM head) stay int8 in the int4 format."""
    parts = _parts(gguf_types, param)
    return not parts or all(t in GGUF_4BIT for t in parts)


def auto_format(gguf_types: dict[str, str] | None) -> str:
    """`auto`: float32 for every checkpoint. The bf16-activation formats are opt-in: their products
    round differently with the number of rows in a batch, so a request's greedy tokens can differ
    between a batch where its prefix was cached and one where it was not (cache on != off under
    batching, tests/integration/test_cache_equivalence.py), which float32 keeps equal."""
    return "float32"


def quantize_model(model: nn.Module, weight_format: str, gguf_types: dict[str, str]) -> None:
    """Replace every projection of a bf16 `LlamaForCausalLM` with an int8 / int4 linear, and give
    a tied model its own quantized LM head (the embedding table stays bf16 for the lookup)."""
    from radix_runtime.worker.layers import Linear

    def convert(name: str, lin: Linear) -> nn.Module:
        w = lin.weight.data.float()
        bias = None if lin.bias is None else lin.bias.data
        if weight_format == "int8" or not _int4_keeps(gguf_types, name + ".weight"):
            return Int8Linear(w, bias)
        return Int4Linear(w, bias, int4_fit(gguf_types, name + ".weight"))

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Linear):
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, convert(full, child))
    if model.lm_head is None:  # tied: the head reads the embedding table (and its GGUF type)
        head = Linear.__new__(Linear)
        nn.Module.__init__(head)
        head.weight, head.bias = model.model.embed_tokens.weight, None
        model.lm_head = convert("model.embed_tokens", head)
