"""Quantized weights: FP8 (W8A8) layers, and the readers of quantized checkpoints.

Formats (the scheme comes from config.json's `quantization_config`, parsed and refused by name in
model_config.py; `--quantization fp8` quantizes an unquantized checkpoint at load):

- **FP8 W8A8** (`quant_method: fp8`, and compressed-tensors `float-quantized` 8-bit weights):
  every projection inside the decoder layers becomes an `Fp8Linear`: e4m3 weights with one float32
  scale per output row (a per-tensor checkpoint scale is repeated over its rows, which is exact;
  the fused q/k/v and gate/up rows keep each shard's own scale), activations quantized per token
  at run time (dynamic scales; a checkpoint's static `input_scale` is not used). CUDA runs
  `torch._scaled_mm` (FP8 tensor cores, row-wise scales); elsewhere the weight is dequantized
  once and each activation row goes through the same FP8 rounding, so the CPU computes what the
  GPU computes up to accumulation order. lm_head and the embeddings stay unquantized (as vLLM's
  FP8 does).
- **int4 weight-only** (AWQ GEMM layout, GPTQ with desc_act false): on CUDA (with the kernels and
  `KernelConfig.int4_gemv`) every decoder projection becomes an `Int4Linear` that keeps the
  weights packed (repacked at load into kernels/int4_gemv.py's row layout), decode rows run the
  Triton int4 GEMV; elsewhere the weights are dequantized to the model dtype while loading and
  the model runs as an unquantized one.
- **int4 round-to-nearest at load** (`--quantization int4`): AWQ's asymmetric grid, groups of 128
  input columns, the same two ways: packed `Int4Linear`s on CUDA, kept dequantized elsewhere
  (W4A16's accuracy at the model dtype's memory and speed).
- FP8 KV scales a checkpoint carries (`self_attn.k_scale` / `v_scale`, or compressed-tensors'
  `k_proj.output_scale` / `v_proj.output_scale`) are collected for an FP8 KV pool.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radix_runtime.worker.kernels import fp8_quant
from radix_runtime.worker.kernels.int4_gemv import (
    dequantize_int4,
    int4_gemv_scales,
    interleave_quads,
    pack_int4_rows,
)
from radix_runtime.worker.layers.linear import Linear
from radix_runtime.worker.model_config import UnsupportedModel

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# AutoAWQ packs 8 int4 values into an int32 along the output dim in this order: the value of
# column 8*j + AWQ_ORDER[i] sits in bits [4i, 4i + 4) of qweight[:, j]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_KV_SCALE = re.compile(
    r"model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$"
)


# ---------------------------------------------------------------------------------------------
# FP8 W8A8


def quantize_rows_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3 [N, K], float32 scale [N]) with each row's max at 448."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_(min=1e-12)
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in FP8 e4m3 (per-output-row scale) and x quantized per token."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8))
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self._dequantized: torch.Tensor | None = None  # the CPU path's weight, built once

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Fp8Linear:
        out_f, in_f = linear.weight.shape
        bias = linear.bias is not None
        with torch.device("meta"):
            layer = cls(in_f, out_f, bias, linear.weight.dtype)
        q, scale = quantize_rows_fp8(linear.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        if bias:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.is_cuda:
            out = fp8_linear_cuda(x2, self.weight, self.weight_scale, self.bias)
        else:
            if self._dequantized is None or self._dequantized.dtype != x.dtype:
                self._dequantized = dequantize_rows(self.weight, self.weight_scale, x.dtype)
            xq, xs = fp8_quant.quantize_rows_fp8_torch(x2)  # per token, as the GPU's
            out = F.linear((xq.float() * xs).to(x.dtype), self._dequantized, self.bias)
        return out.reshape(*shape[:-1], out.shape[-1])


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def fp8_linear_cuda(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """FP8 tensor cores: row-wise scales on both sides (per token, per output channel)."""
    xq, xs = fp8_quant.quantize_rows_fp8(x)  # Triton: CUDA only
    return torch._scaled_mm(
        xq, w.t(), scale_a=xs, scale_b=w_scale.view(1, -1), bias=bias, out_dtype=x.dtype
    )


def decoder_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, layer) of every projection inside the decoder layers."""
    out = []
    for parent in model.model.layers.modules():
        for name, child in parent.named_children():
            if isinstance(child, (Linear, Fp8Linear)):
                out.append((parent, name, child))
    return out


def use_fp8_layers(model: nn.Module, device: torch.device) -> None:
    """Before loading an FP8 checkpoint: every decoder projection becomes an empty Fp8Linear."""
    for parent, name, layer in decoder_linears(model):
        out_f, in_f = layer.weight.shape
        with torch.device(device):
            setattr(
                parent, name, Fp8Linear(in_f, out_f, layer.bias is not None, layer.weight.dtype)
            )
    model.requires_grad_(False)
    model.quantization = "fp8"


def quantize_model_fp8(model: nn.Module) -> None:
    """--quantization fp8: quantize every loaded decoder projection (per output row)."""
    for parent, name, layer in decoder_linears(model):
        if isinstance(layer, Linear):
            setattr(parent, name, Fp8Linear.from_linear(layer))
    model.quantization = "fp8"


def quantize_lm_head_fp8(model: nn.Module) -> None:
    """--quantize-lm-head (FP8 or int4 decoder projections): the LM head becomes an Fp8Linear
    (per-row scales) made from the head's weight, or from the embedding table when the two are tied (the table itself stays in the
    model dtype for the lookups)."""
    head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    w = head.weight.data
    with torch.device("meta"):
        layer = Fp8Linear(w.shape[1], w.shape[0], False, w.dtype)
    q, scale = quantize_rows_fp8(w)
    layer.weight = nn.Parameter(q, requires_grad=False)
    layer.weight_scale = nn.Parameter(scale, requires_grad=False)
    model.lm_head = layer


# ---------------------------------------------------------------------------------------------
# int4 weight-only (W4A16)

INT4_GROUP = 128


def int4_group_size(k: int) -> int:
    """128 input columns per group, or the largest power of two below it that divides `k`
    (SmolLM2's 576 columns: 64)."""
    g = INT4_GROUP
    while k % g:
        g //= 2
    return g


def rtn_int4_parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """W [N, K] on the asymmetric int4 grid of AWQ (per group of input columns: scale =
    (max - min) / 15, integer zero point): (q [N, K], zeros [N, K/g], float32 scales [N, K/g], g)."""
    n, k = w.shape
    group = int4_group_size(k)
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / 15
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale + zero).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), zero[..., 0].to(torch.uint8), scale[..., 0], group


def rtn_int4(w: torch.Tensor) -> torch.Tensor:
    """`rtn_int4_parts`, returned dequantized in W's dtype."""
    q, zero, scale, group = rtn_int4_parts(w)
    return dequantize_groups(q, zero, scale, group).to(w.dtype)


def dequantize_groups(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """q [N, K], zeros and scales [N, ceil(K/g)] -> float32 W [N, K] = (q - zero) * scale."""
    k = q.shape[1]
    z = zeros.float().repeat_interleave(group_size, dim=1)[:, :k]
    s = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    return (q.float() - z) * s


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W kept packed: int4 values (kernels/int4_gemv.py's layout), float32
    scales and uint8 zero points per group of `group_size` input columns.

    A checkpoint fills `qweight` row by row (int32 [N, K/8], `pack_int4_rows`, so the fused q/k/v
    and gate/up shards go to their row slices); `finish()` (the loader calls it once every
    parameter is filled) interleaves it into the kernels' [N/4, K/8, 4] and builds the GEMV's
    `gemv_scales`. On CUDA the fused path runs decode rows through the Triton int4 GEMV
    (`FusedOps.project` / `row_project`); this forward (any other caller, prefill) dequantizes
    the weight for each call."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group_size: int
    ) -> None:
        super().__init__()
        groups = -(-in_features // group_size)
        self.group_size = group_size
        self.qweight = nn.Parameter(
            torch.empty(out_features, in_features // 8, dtype=torch.int32), requires_grad=False
        )
        self.scales = nn.Parameter(
            torch.empty(out_features, groups, dtype=torch.float32), requires_grad=False
        )
        self.zeros = nn.Parameter(
            torch.empty(out_features, groups, dtype=torch.uint8), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self.register_buffer("gemv_scales", None, persistent=False)  # by finish()

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Int4Linear:
        """Round a loaded projection to int4 (`rtn_int4_parts`) and pack it."""
        out_f, in_f = linear.weight.shape
        q, zero, scale, group = rtn_int4_parts(linear.weight.data)
        with torch.device("meta"):
            layer = cls(in_f, out_f, linear.bias is not None, linear.weight.dtype, group)
        layer.qweight = nn.Parameter(pack_int4_rows(q), requires_grad=False)
        layer.scales = nn.Parameter(scale.contiguous(), requires_grad=False)
        layer.zeros = nn.Parameter(zero.contiguous(), requires_grad=False)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        layer.finish()
        return layer

    def finish(self) -> None:
        """The loaded rows -> the kernels' layout (once)."""
        if self.gemv_scales is None:
            self.qweight = nn.Parameter(interleave_quads(self.qweight.data), requires_grad=False)
            self.gemv_scales = int4_gemv_scales(self.scales.data, self.zeros.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, x.dtype)
        return F.linear(x, w, self.bias)


def finish_int4_layers(model: nn.Module) -> None:
    """After an int4 checkpoint is loaded packed: every Int4Linear in the kernels' layout."""
    for layer in model.modules():
        if isinstance(layer, Int4Linear):
            layer.finish()


def int4_packable(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the int4 kernels take a projection: whole packed words along K, groups of them,
    and whole quads of rows."""
    return out_features % 4 == 0 and in_features % 8 == 0 and group_size % 8 == 0


def use_int4_layers(model: nn.Module, device: torch.device, scheme: dict[str, Any]) -> bool:
    """Before loading an AWQ / GPTQ checkpoint packed (`int4_checkpoint(packed=True)`): every
    decoder projection becomes an empty Int4Linear of the scheme's group size. False (nothing
    changed: load it dequantized) when a projection's shape does not fit the kernels."""
    layers = decoder_linears(model)
    groups = [scheme["group_size"] if scheme["group_size"] > 0 else lay.weight.shape[1]
              for _, _, lay in layers]  # fmt: skip
    if not all(int4_packable(*lay.weight.shape, g) for (_, _, lay), g in zip(layers, groups)):
        return False
    for (parent, name, layer), group in zip(layers, groups):
        out_f, in_f = layer.weight.shape
        with torch.device(device):
            setattr(
                parent,
                name,
                Int4Linear(in_f, out_f, layer.bias is not None, layer.weight.dtype, group),
            )
    model.quantization = scheme["method"]
    model.packed_int4 = True
    return True


def quantize_model_int4_rtn(model: nn.Module, packed: bool = False) -> None:
    """--quantization int4: every decoder projection rounded to int4 (`rtn_int4_parts`): packed
    into an Int4Linear (`packed`: CUDA with the int4 kernels, where its shape fits them), else
    kept dequantized in place."""
    for parent, name, layer in decoder_linears(model):
        out_f, in_f = layer.weight.shape
        if packed and int4_packable(out_f, in_f, int4_group_size(in_f)):
            setattr(parent, name, Int4Linear.from_linear(layer))
            model.packed_int4 = True
        else:
            layer.weight.data = rtn_int4(layer.weight.data)
    model.quantization = "int4"


# ---------------------------------------------------------------------------------------------
# checkpoints


def fp8_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], kv_scales: dict[int, list[float]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's tensors as the Fp8Linear parameters want them: weight scales flattened
    to one per row (a per-tensor scalar is repeated by the loader), static input scales dropped,
    KV scales collected into `kv_scales`."""
    for name, t in weights:
        if _take_kv_scale(name, t, kv_scales):
            continue
        if name.endswith(".input_scale"):
            continue  # activations get dynamic per-token scales
        if name.startswith("lm_head.") and t.dtype == FP8:
            raise UnsupportedModel("an FP8 lm_head is not supported (only decoder projections)")
        if name.endswith(".weight_scale") or name.endswith(".weight_scale_inv"):
            name = name.removesuffix("_inv")
            t = t.float().reshape(-1)
        yield name, t


def _take_kv_scale(name: str, t: torch.Tensor, kv_scales: dict[int, list[float]]) -> bool:
    match = _KV_SCALE.match(name)
    if match is None:
        return False
    layer, which = int(match.group(1)), match.group(2) or match.group(3)
    kv_scales.setdefault(layer, [1.0, 1.0])[0 if which == "k" else 1] = float(t.float().max())
    return True


def int4_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]],
    scheme: dict[str, Any],
    dtype: torch.dtype,
    kv_scales: dict[int, list[float]],
    packed: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """AWQ / GPTQ tensors -> HF-named float weights in `dtype`, or with `packed` the Int4Linear
    tensors (`qweight`, `scales`, `zeros` in kernels/int4_gemv.py's layout); each projection once
    its qweight, qzeros and scales have all been read (safetensors files list keys in any order)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        if _take_kv_scale(name, t, kv_scales):
            continue
        prefix, _, leaf = name.rpartition(".")
        if leaf == "g_idx":
            continue  # desc_act false: group = input row // group_size (checked at config time)
        if leaf not in ("qweight", "qzeros", "scales"):
            yield name, t
            continue
        got = parts.setdefault(prefix, {})
        got[leaf] = t
        if len(got) == 3:
            del parts[prefix]
            if scheme["method"] == "awq":
                q, z, s = unpack_awq(got["qweight"], got["qzeros"], got["scales"])
            else:
                q, z, s = unpack_gptq(got["qweight"], got["qzeros"], got["scales"],
                                      zero_offset=scheme.get("zero_offset", 1))  # fmt: skip
            group = scheme["group_size"] if scheme["group_size"] > 0 else q.shape[1]
            if packed:
                yield f"{prefix}.qweight", pack_int4_rows(q)
                yield f"{prefix}.scales", s.contiguous()
                yield f"{prefix}.zeros", z.to(torch.uint8).contiguous()
            else:
                yield f"{prefix}.weight", dequantize_groups(q, z, s, group).to(dtype)
    if parts:
        raise ValueError(f"incomplete int4 tensors for {sorted(parts)[:4]} (qweight/qzeros/scales)")


def _unpack_int4(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C] -> int [R, 8 C]: value 8 j + order[i] from bits [4 i, 4 i + 4) of column j."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, device=p.device)
    nibbles = (p[:, :, None] >> shifts) & 0xF  # [R, C, 8]: nibble i
    out = torch.empty_like(nibbles)
    out[:, :, list(order)] = nibbles
    return out.reshape(p.shape[0], -1)


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM layout: qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N] -> q [N, K],
    zeros [N, K/g], float32 scales [N, K/g]."""
    q = _unpack_int4(qweight, AWQ_ORDER).t()
    z = _unpack_int4(qzeros, AWQ_ORDER).t()
    return q, z, scales.float().t()


def unpack_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, zero_offset: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ (AutoGPTQ / GPTQModel): qweight [K/8, N] packed along the input dim, qzeros [K/g, N/8]
    packed along the output dim, both in plain order; format v1 stores zero - 1 (`zero_offset`
    1), v2 the zero itself. -> q [N, K], zeros [N, K/g], float32 scales [N, K/g]."""
    order = tuple(range(8))
    q = _unpack_int4(qweight.t().contiguous(), order)  # [N, K]
    z = _unpack_int4(qzeros, order).t() + zero_offset
    return q, z, scales.float().t()
