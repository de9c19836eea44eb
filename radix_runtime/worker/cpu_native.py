"""The CPU decoder stack in one C++ call (csrc/cpu_decoder.cpp, the `_cpu_decoder` extension).

A batch-1 decode step of the default model is ~60 small ATen operations a layer over 30 layers;
from Python each carries interpreter and `nn.Module` overhead that outweighs the operation itself
(docs/decisions.md, "The CPU decoder step in C++"). `CpuDecoder` holds the layers' weights and the
KV pool's per-layer views and runs the same operations, in the same order and dtypes, from C++:
the outputs are bitwise those of the Python modules, in every CPU weight format.

It serves what the torch-native backend plans for a Llama-family model (`LlamaForCausalLM`
itself: Qwen3's q/k norms and Gemma's layers stay on the Python path) with one attention window,
a non-FP8 pool, no tensor parallelism and the CPU weight formats' projections. Anything else,
a missing or stale extension (built for another torch), or `--disable-cpu-native-decoder` runs
the Python modules.
"""

from __future__ import annotations

import logging

import torch

from radix_runtime.worker import cpu_quant
from radix_runtime.worker.attention.torch_native import TorchNativeBackend
from radix_runtime.worker.cpu_quant import QuantLinear
from radix_runtime.worker.kv_pool import KVPool
from radix_runtime.worker.layers import Linear, RMSNorm
from radix_runtime.worker.layers.linear import RowParallelLinear

logger = logging.getLogger(__name__)

_DENSE = 0  # and cpu_quant.KIND_INT8 / KIND_INT4


def load_extension():
    """The compiled module, or None (with the reason logged once) when it cannot be imported."""
    global _EXTENSION
    if _EXTENSION is None:
        try:
            from radix_runtime.worker import _cpu_decoder

            _EXTENSION = _cpu_decoder
        except ImportError as exc:  # not built, or built against another torch
            logger.info("the C++ CPU decoder is not available (%s): Python layers", exc)
            _EXTENSION = False
    return _EXTENSION or None


_EXTENSION = None


def _projection(layer: torch.nn.Module) -> tuple | None:
    """(kind, weight, bias, out_features, in_features, act_passes) of a projection, None if
    not ours."""
    if isinstance(layer, QuantLinear):
        shape = layer.out_features, layer.in_features
        return layer.kind, layer.packed, layer.bias, *shape, layer.act_passes
    if type(layer) is Linear or (type(layer) is RowParallelLinear and layer.tp_size == 1):
        bias = None if layer.bias is None else layer.bias.data
        return _DENSE, layer.weight.data, bias, *layer.weight.shape, 1
    return None


def _why_not(model, kv_pool: KVPool, attn) -> str | None:
    """Why the native decoder cannot run this model with this pool and backend (None: it can)."""
    from radix_runtime.worker.models.llama import LlamaForCausalLM

    c = model.config
    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} has layers of its own"
    if model._ops is not None or kv_pool.device.type != "cpu":
        return "not the CPU path"
    if c.tp_size > 1:
        return "tensor parallelism"
    if type(attn) is not TorchNativeBackend or attn.windows() != [0]:
        return "attention windows or another backend"
    if kv_pool.is_fp8 or kv_pool.act_dtype != kv_pool.dtype:
        return "an FP8 KV pool"
    for layer in model.model.layers:
        if layer.mlp.act_name not in ("silu", "swish"):
            return f"activation {layer.mlp.act_name}"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm for n in norms):
            return "another norm"
        a, mlp = layer.self_attn, layer.mlp
        projections = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(_projection(p) is None for p in projections):
            return "a projection of another kind"
        if cpu_quant.kernels() is None and any(isinstance(p, QuantLinear) for p in projections):
            return "the quantized kernels' torch twin"
    return None


class CpuDecoder:
    """The decoder layers of one model over one KV pool, run by the C++ extension."""

    def __init__(self, ext, model, kv_pool: KVPool, attn: TorchNativeBackend) -> None:
        c = model.config
        self.kv_pool, self.attn = kv_pool, attn
        self._impl = ext.CpuDecoder(
            c.num_heads, c.num_kv_heads, c.head_dim, float(c.rms_norm_eps), float(attn.scale)
        )
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self._impl.add_layer(
                layer.input_layernorm.weight.data,
                layer.post_attention_layernorm.weight.data,
                [_projection(p) for p in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)],
            )
        n = c.num_layers
        self._impl.bind_pool(
            [kv_pool.k_flat(i) for i in range(n)], [kv_pool.v_flat(i) for i in range(n)]
        )

    def serves(self, attn, kv_pool: KVPool) -> bool:
        return attn is self.attn and kv_pool is self.kv_pool

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The residual stream after the last layer (before the final norm), for the batch the
        backend planned last."""
        decode, prefills = self.attn._plans[0]
        dec = None
        if decode is not None:
            dec = (decode.rows, *_keys(decode), *decode.shape, decode.mask)
        chunks = [_chunk(p, h.dtype) for p in prefills]
        return self._impl.forward(h, cos, sin, self.attn._out_cache_loc, dec, chunks)


def _chunk(p, dtype: torch.dtype) -> tuple:
    """A prefill chunk as the extension takes it; a row-kernel chunk (torch_native's
    `row_prefix`) reads its keys through its locations whether or not they make a span."""
    a, b, locs = _keys(p)
    if p.row_prefix >= 0:
        locs = p.kv_locs
    return p.start, p.end, a, b, locs, p.attn_mask(dtype), p.grouped, p.row_prefix


def _keys(plan) -> tuple[int, int, torch.Tensor | None]:
    """Where a planned group reads its keys, as the extension takes it: (a, b, None) for the
    pool's slice [a, b), else (-1, -1, its locations)."""
    if plan.span is not None:
        return (*plan.span, None)
    return -1, -1, plan.kv_locs


def build(model, kv_pool: KVPool, attn) -> CpuDecoder | None:
    """The native decoder for this model, pool and backend, or None (the reason logged)."""
    ext = load_extension()
    if ext is None:
        return None
    reason = _why_not(model, kv_pool, attn)
    if reason is not None:
        logger.info("C++ CPU decoder not used: %s", reason)
        return None
    return CpuDecoder(ext, model, kv_pool, attn)
