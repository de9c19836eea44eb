"""Weight formats of the CPU path: float32, bfloat16, and weight-only int8 / int4 linears.

The quantized linears run our own kernels (csrc/cpu_quant_kernels.cpp, in the `_cpu_decoder`
extension) the way llama.cpp runs its Q4/Q8 files: the weights repacked once at load into the
order the kernel streams, each activation row quantized to int8 per block of 32 (a float scale
and the block's sum), integer dot products (AVX512-VNNI, AVX2 or scalar, chosen at run time), one
fixed-order float epilogue. A row's result is the same whatever else is in the call and however
many threads run it (batch-invariant), so greedy outputs with the radix cache on equal cache off
in batches too. Without the extension (or with RADIX_CPU_KERNEL_ISA=torch) `quant_linear_torch`
computes the same products with torch operations (equal to float rounding, not bitwise).

- ``int8``: blocks of 32 input columns with an fp16 scale each, ``w = d * q``, q in -127..127
  (GGUF's Q8_0 exactly).
- ``int4``: blocks of 32 with an fp16 scale and offset, ``w = d * q + m``, q in 0..15 (Q4_1's
  form; Q4_0 is ``m = -8 d``).

A GGUF file's 4-bit groups map onto the int4 layout without a new rounding of the weights: Q4_1
keeps its grid with an asymmetric min/max fit of each group (its quantizer puts the group's min
at q = 0 and max at q = 15), Q4_0 with a symmetric fit (its largest magnitude sits at q = 0);
their fp16 d and m are the file's. Q8_0 keeps its blocks in int8. Every other source (K-quants,
F16/F32, safetensors) is requantized from the dequantized float32 values: int8 blocks, or min/max
int4 groups of 32 (K-quants' 6-bit sub-block scales do not always span q = 0..15, so their 4-bit
groups are refitted, at most half a step off).

The tied embedding stays a float32 table for the lookup; its use as the LM head becomes a separate
quantized linear (float32 logits). In the int4 format a GGUF matrix stored at more than 4 bits
(the default model's Q8_0 embedding) stays int8: int4 never makes a weight coarser than the
file's. docs/cpu_weight_formats.md has the accuracy and speed behind `auto`.
"""

from __future__ import annotations

import os

import torch
from torch import nn

CPU_WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4")
INT4_GROUP = 32  # input columns per block (one weight scale, one activation scale)
TILE = 16  # output rows per packed tile
KIND_INT8, KIND_INT4 = 1, 2  # csrc/cpu_quant_kernels.h
RECORD_BYTES = {KIND_INT8: 8 * 64 + 32, KIND_INT4: 4 * 64 + 2 * 32}
# GGUF tensor types whose 4-bit grid the int4 layout holds as it is (see the module docstring)
GGUF_INT4_EXACT = {"Q4_0": "symmetric", "Q4_1": "asymmetric"}
# GGUF types that are 4-bit (or less) already: int4 adds no precision loss worth keeping 8 bits for
GGUF_4BIT = {"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"}
# NOTE: activation rows quantized in two int8 passes (the block, then what its rounding left):
# a few channels of the norms' outputs are far larger than the rest, and one 8-bit pass around
# them moves the default model's logits by up to ~1.6 (its "Paris" hangs on a 0.08 margin); two
# put the int4 model within 0.003 of float32 for ~no cost in a memory-bound decode step
# (docs/cpu_weight_formats.md has the figures)
ACT_PASSES = 2
KERNEL_ISA_ENV = "RADIX_CPU_KERNEL_ISA"  # avx512_vnni | avx2 | scalar | torch (default: best)


def kernels():
    """The compiled kernels (the `_cpu_decoder` extension), or None: not built, built for another
    torch, or RADIX_CPU_KERNEL_ISA=torch (the torch twin, for tests)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = False
        if os.environ.get(KERNEL_ISA_ENV) != "torch":
            from radix_runtime.worker import cpu_native  # (it imports this module)

            # the one import of the extension (it logs why when there is none)
            _KERNELS = cpu_native.load_extension() or False
    return _KERNELS or None


_KERNELS = None


# ---------------------------------------------------------------------------------------------
# weights -> (q, d, m) blocks


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K'], fp16 scales [N, K'/32]), K' = K rounded up to 32:
    symmetric blocks of 32 (Q8_0's quantizer: the block's largest magnitude at +-127)."""
    g = _blocks(w.float())
    d = (g.abs().amax(dim=-1) / 127.0).half()
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d.float())
    q = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(w.shape[0], -1), d


def int4_groups(
    w: torch.Tensor, fit: str = "asymmetric"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q uint8 [N, K] in 0..15, d fp16 [N, K/32], m fp16 [N, K/32]), w ~= d q + m.

    `asymmetric`: d = (max - min) / 15, m = min (Q4_1's quantizer); `symmetric`: d = -(the
    group's value of largest magnitude) / 8, m = -8 d (Q4_0's)."""
    n, k = w.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs input features divisible by {INT4_GROUP}, got {k}")
    g = w.float().reshape(n, k // INT4_GROUP, INT4_GROUP)
    if fit == "symmetric":
        idx = g.abs().argmax(dim=-1, keepdim=True)
        d = (-g.gather(-1, idx) / 8.0).half().float()
        d = torch.where(d == 0, torch.ones_like(d), d)
        m = -8.0 * d
    else:
        lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
        d = ((hi - lo) / 15.0).half().float()
        m = lo.half().float()
        d = torch.where(d == 0, torch.full_like(d, 1e-7), d)
    q = torch.round((g - m) / d).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return q, d[..., 0].half(), m[..., 0].half()


def dequantize_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The float32 weights an `int4_groups` result stands for (tests, accuracy reports)."""
    d = d.float().repeat_interleave(INT4_GROUP, dim=1)
    m = m.float().repeat_interleave(INT4_GROUP, dim=1)
    return q.float() * d + m


def dequantize_int8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return q.float() * d.float().repeat_interleave(INT4_GROUP, dim=1)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, ceil(K/32), 32], zero-padded."""
    n, k = w.shape
    pad = -k % INT4_GROUP
    return torch.nn.functional.pad(w, (0, pad)).view(n, -1, INT4_GROUP)


# ---------------------------------------------------------------------------------------------
# the packed layout (csrc/cpu_quant_kernels.cpp's header comment): [N/16, K/32, record] uint8


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [ceil(N/16), 16, ...], zero-padded rows."""
    pad = -t.shape[0] % TILE
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.view(-1, TILE, *t.shape[1:])


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp16 [T, 16, B] -> uint8 [T, B, 32] (the 16 values of a tile's block, little-endian)."""
    return x.half().transpose(1, 2).contiguous().view(torch.uint8)


def pack_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(q [N, K] 0..15, d, m [N, K/32]) -> packed [N/16, K/32, 320] uint8."""
    qt = _tiles(q.to(torch.uint8)).view(-1, TILE, q.shape[1] // INT4_GROUP, 2, 4, 4)
    # [T, 16 rows, B, half, j, t] -> [T, B, j, rows, t, half]; k = 32 b + 16 half + 4 j + t
    qt = qt.permute(0, 2, 4, 1, 5, 3)
    nibbles = (qt[..., 0] | (qt[..., 1] << 4)).reshape(qt.shape[0], qt.shape[1], 256)
    return torch.cat([nibbles, _half_bytes(_tiles(d)), _half_bytes(_tiles(m))], -1).contiguous()


def pack_int8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(q [N, K'] int8, d [N, K'/32]) -> packed [N/16, K'/32, 544] uint8 (bytes q + 128)."""
    u = (_tiles(q).to(torch.int16) + 128).to(torch.uint8)  # padding rows: q = 0
    ut = u.view(-1, TILE, q.shape[1] // INT4_GROUP, 8, 4)
    body = ut.permute(0, 2, 3, 1, 4).reshape(ut.shape[0], ut.shape[2], 512)  # [T, B, j, rows, t]
    return torch.cat([body, _half_bytes(_tiles(d))], -1).contiguous()


def unpack(packed: torch.Tensor, kind: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """packed -> (q int32 [N', K'] as the weights' integers, d, m float32 [N', K'/32]);
    m is zeros for int8."""
    t, b, _ = packed.shape
    if kind == KIND_INT4:
        nib = packed[..., :256].view(t, b, 4, TILE, 4).to(torch.int32)
        q = torch.stack([nib & 15, nib >> 4], -1)  # [T, B, j, rows, t, half]
        q = q.permute(0, 3, 1, 5, 2, 4).reshape(t * TILE, b * INT4_GROUP)
        scales = packed[..., 256:].contiguous().view(torch.float16).view(t, b, 2, TILE)
        d, m = scales[:, :, 0], scales[:, :, 1]
    else:
        u = packed[..., :512].view(t, b, 8, TILE, 4).to(torch.int32) - 128
        q = u.permute(0, 3, 1, 2, 4).reshape(t * TILE, b * INT4_GROUP)
        d = packed[..., 512:].contiguous().view(torch.float16).view(t, b, TILE)
        m = torch.zeros_like(d)

    def rows(x):  # [T, B, 16] -> [T*16, B]
        return x.permute(0, 2, 1).reshape(t * TILE, b).float()

    return q, rows(d), rows(m)


# ---------------------------------------------------------------------------------------------
# the products


def quantize_rows_torch(x: torch.Tensor, blocks: int):
    """[R, K] -> (xq float [R, B, 32] integer-valued, dx [R, B], dx * sum(xq) [R, B]): the
    kernels' activation quantization."""
    g = torch.nn.functional.pad(x.float(), (0, blocks * INT4_GROUP - x.shape[1]))
    g = g.view(x.shape[0], blocks, INT4_GROUP)
    dx = g.abs().amax(dim=-1) / 127.0
    inv = torch.where(dx == 0, torch.zeros_like(dx), 1.0 / dx)
    xq = torch.round(g * inv[..., None])
    return xq, dx, dx * xq.sum(-1)


def quant_linear_torch(
    x: torch.Tensor,
    packed: torch.Tensor,
    kind: int,
    out_features: int,
    in_features: int,
    bias: torch.Tensor | None = None,
    float_out: bool = False,
    act_passes: int = 1,
) -> torch.Tensor:
    """`quant_linear` (the C++ kernels) in torch operations: the same integer dots and float
    factors, summed over blocks in torch's order (equal to float rounding, not bitwise)."""
    q, d, m = unpack(packed, kind)
    n_pad, blocks = d.shape
    w = q.float().view(n_pad, blocks, INT4_GROUP)
    rows = x.reshape(-1, in_features)
    out = torch.empty(rows.shape[0], out_features)
    for i in range(0, rows.shape[0], 64):  # bounded temporaries: [64, N, B]
        part = rows[i : i + 64].float()
        y = 0
        for _ in range(act_passes):  # the second pass: what the first's rounding left
            xq, dx, mdx = quantize_rows_torch(part, blocks)
            dots = torch.einsum("rbk,nbk->rnb", xq, w)  # integer-valued and exact in float32
            y = y + (dots * (d[None] * dx[:, None])).sum(-1) + (m[None] * mdx[:, None]).sum(-1)
            part = (xq * dx[..., None]).flatten(1)[:, : part.shape[1]].neg_().add_(part)
        out[i : i + 64] = y[:, :out_features]
    if bias is not None:
        out += bias.float()
    out = out if float_out else out.to(x.dtype)
    return out.view(*x.shape[:-1], out_features)


class QuantLinear(nn.Module):
    """A linear over packed int8 / int4 weights: y = x W^T (+ bias), x float32 or bf16."""

    kind: int

    def __init__(self, packed: torch.Tensor, out_features: int, in_features: int, bias) -> None:
        super().__init__()
        self.register_buffer("packed", packed)
        # float32 and a plain attribute: the model's .to(bfloat16) leaves it alone
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features, self.in_features = out_features, in_features
        self.float_out = False  # the LM head returns float32 logits
        self.act_passes = ACT_PASSES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ext = kernels()
        op = quant_linear_torch if ext is None else ext.quant_linear
        args = (self.packed, self.kind, self.out_features, self.in_features)
        return op(x, *args, self.bias, self.float_out, self.act_passes)


class Int8Linear(QuantLinear):
    kind = KIND_INT8

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        q, d = quantize_int8(weight)
        super().__init__(pack_int8(q, d), *weight.shape, bias)


class Int4Linear(QuantLinear):
    kind = KIND_INT4

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fit: str) -> None:
        super().__init__(pack_int4(*int4_groups(weight, fit)), *weight.shape, bias)


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


# GGUF types our int8 / int4 layouts hold exactly (the file's own grid, scales and offsets)
GGUF_EXACT = {"Q4_0", "Q4_1", "Q8_0"}


def auto_format(gguf_types: dict[str, str] | None) -> str:
    """`auto`: int4 when the checkpoint is a GGUF file whose matrices are all Q4_0 / Q4_1 / Q8_0
    (int4 keeps the 4-bit ones and int8 the Q8_0 ones exactly: only the activations' two-pass
    int8 rounding differs from float32, 0.007 logits on the default model) and this CPU runs our
    kernels with SIMD; int8 for an all-Q8_0 file; float32 otherwise (docs/cpu_weight_formats.md).
    The kernels are batch-invariant, so cache on == off holds in batches as with float32."""
    matrices = {
        name: t
        for name, t in (gguf_types or {}).items()
        if name.endswith("proj.weight") or name.endswith(("embed_tokens.weight", "lm_head.weight"))
    }
    if not matrices or not set(matrices.values()) <= GGUF_EXACT or not fast_kernels():
        return "float32"
    return "int8" if set(matrices.values()) == {"Q8_0"} else "int4"


def fast_kernels() -> bool:
    """Whether the compiled kernels run here with SIMD (the scalar path and the torch twin are
    correct but slower than float32)."""
    ext = kernels()
    return ext is not None and ext.kernel_isa() in ("avx512_vnni", "avx2")


def quantize_model(model: nn.Module, weight_format: str, gguf_types: dict[str, str]) -> None:
    """Replace every projection of a float32 `LlamaForCausalLM` with an int8 / int4 linear, and give
    a tied model its own quantized LM head (the embedding table stays for the lookup)."""
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
    if isinstance(model.lm_head, QuantLinear):
        model.lm_head.float_out = True
