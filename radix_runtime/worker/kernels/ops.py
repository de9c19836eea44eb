"""FusedOps: the kernel set a model's CUDA path calls, bound to one KernelConfig.

The models call `ops.rmsnorm(...)`, `ops.project(x, layer)` and so on; the choices that a
config makes (Triton GEMV or cuBLAS for single rows, the one-token fused path or not, the GEMV
table) are read here and in the attention backend, so a runner built with another config runs
other kernels without any module state changing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radix_runtime.worker.kernels import activation, fp8_gemv, gemv, int4_gemv, norms, rope
from radix_runtime.worker.kernels.config import KernelConfig
from radix_runtime.worker.kernels.int4_gemv import INT4_NORM, INT4_PLAIN, INT4_SILU


class FusedOps:
    # stateless kernels: the same whatever the config
    rmsnorm = staticmethod(norms.rmsnorm)
    fused_add_rmsnorm = staticmethod(norms.fused_add_rmsnorm)
    gemma_rmsnorm = staticmethod(norms.gemma_rmsnorm)
    silu_and_mul = staticmethod(activation.silu_and_mul)
    gelu_tanh_and_mul = staticmethod(activation.gelu_tanh_and_mul)

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.row_fusion = config.row_fusion
        self.pdl = config.use_pdl()  # launch the Triton kernels dependently

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, **kw) -> torch.Tensor:
        """`kernels.gemv.gemv` with this config's table."""
        return gemv.gemv(x, weight, table=self.config.gemv_configs, pdl=self.pdl, **kw)

    def rotary_qk(self, *args, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.rotary_qk(*args, pdl=self.pdl, **kw)

    def gemma_norm_add_norm(self, *args) -> torch.Tensor:
        return norms.gemma_norm_add_norm(*args, pdl=self.pdl)

    def gated_project(self, x: torch.Tensor, layer: torch.nn.Module, act: str) -> torch.Tensor:
        """layer(act(x[:, :I]) * x[:, I:]) for act "silu" or "gelu_tanh": at one row of a plain
        or FP8 layer without bias the activation is the GEMV's prologue, else its own kernel
        before `project`."""
        if (
            self.config.triton_gemv
            and x.shape[0] == 1
            and x.is_contiguous()
            and getattr(layer, "qweight", None) is None
            and layer.bias is None
            and layer.weight.is_contiguous()
            and not self._fp8_mma(x, layer)
        ):
            kw = {"silu": True} if act == "silu" else {"gelu": True}
            return self.gemv(x, layer.weight, w_scale=getattr(layer, "weight_scale", None), **kw)
        kw = {"silu": True} if act == "silu" else {"gelu": True}
        if self._fp8_mma(x, layer):
            return fp8_gemv.fp8_mma_gemv(x, layer.weight, layer.weight_scale, pdl=self.pdl, **kw)
        h = self.silu_and_mul(x) if act == "silu" else self.gelu_tanh_and_mul(x)
        return self.project(h, layer)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """F.linear, with the Triton GEMV for single-row inputs (no bias, contiguous operands):
        faster than cuBLAS's batch-1 kernels on every 8B projection and the LM head."""
        if (
            self.config.triton_gemv
            and x.shape[0] == 1
            and bias is None
            and x.is_contiguous()
            and weight.is_contiguous()
        ):
            return self.gemv(x, weight)
        return F.linear(x, weight, bias)

    def row_project(
        self,
        x: torch.Tensor,
        layer: torch.nn.Module,
        *,
        norm_weight: torch.Tensor | None = None,
        eps: float = 1e-6,
        silu: bool = False,
        add_to: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A decoder projection of the one-token path with `gemv`'s prologues and epilogue:
        the int4 GEMV for a packed int4 layer (an Int4Linear, with this config's int4 kernels on),
        else the GEMV (FP8 weights with their per-row scales)."""
        qweight = getattr(layer, "qweight", None)
        fused = dict(norm_weight=norm_weight, eps=eps, silu=silu, add_to=add_to)
        if qweight is not None:
            prologue = INT4_SILU if silu else INT4_NORM if norm_weight is not None else INT4_PLAIN
            config = self._int4_config(qweight, prologue, add_to is not None)
            return int4_gemv.int4_gemv(
                x, qweight, layer.gemv_scales, layer.group_size, config, pdl=self.pdl, **fused
            )
        if self._fp8_mma(x, layer):
            return fp8_gemv.fp8_mma_gemv(x, layer.weight, layer.weight_scale, pdl=self.pdl, **fused)
        return self.gemv(x, layer.weight, w_scale=getattr(layer, "weight_scale", None), **fused)

    def _fp8_mma(self, x: torch.Tensor, layer: torch.nn.Module) -> bool:
        """Whether `x` through the FP8 `layer` takes the tensor-core GEMV (this config's limits
        on input and output rows; no bias; contiguous operands)."""
        return (
            getattr(layer, "weight_scale", None) is not None
            and getattr(layer, "bias", None) is None
            and 1 <= x.shape[0] <= min(self.config.fp8_mma_max_rows, fp8_gemv.FP8_MMA_MAX_ROWS)
            and layer.weight.shape[0] >= self.config.fp8_mma_min_n
            and x.stride(-1) == 1
            and layer.weight.is_contiguous()
        )

    def _int4_config(self, qweight: torch.Tensor, prologue: int, add: bool):
        """This config's int4 GEMV blocks, else the H200 table's for the shape, else None (the
        kernel's default)."""
        key = (qweight.shape[0] * 4, qweight.shape[1] * 8, prologue, add)
        return self.config.int4_gemv_config or int4_gemv.INT4_GEMV_CONFIGS.get(key)

    def project(self, x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
        """A decoder projection: `linear` for a plain layer; for an FP8 one (worker/quant.py's
        Fp8Linear, which has a `weight_scale`) the scaled GEMV at one row, else its own forward
        (FP8 tensor cores); for a packed int4 one (an Int4Linear, which has a `qweight`) the int4
        GEMV (one row, or a few at once), the int4 GEMM or its own forward (dequantized per call)
        by the number of rows."""
        qweight = getattr(layer, "qweight", None)
        if qweight is not None:
            c, rows = self.config, x.shape[0]
            if c.int4_gemv and 1 < rows <= c.int4_rows_max_rows:
                y = int4_gemv.int4_gemv_rows(x, qweight, layer.gemv_scales, layer.group_size)
            elif c.int4_gemv and rows <= c.int4_gemv_max_rows:
                y = int4_gemv.int4_gemv(x, qweight, layer.gemv_scales, layer.group_size,
                                        self._int4_config(qweight, INT4_PLAIN, False))  # fmt: skip
            elif c.int4_gemv and rows <= c.int4_gemm_max_rows:
                y = int4_gemv.int4_gemm(x, qweight, layer.scales, layer.zeros, layer.group_size)
            else:
                return layer(x)
            return y if layer.bias is None else y.add_(layer.bias)
        scale = getattr(layer, "weight_scale", None)
        if scale is None:
            return self.linear(x, layer.weight, layer.bias)
        if self._fp8_mma(x, layer):
            return fp8_gemv.fp8_mma_gemv(x, layer.weight, scale, pdl=self.pdl)
        if self.config.triton_gemv and x.shape[0] == 1 and layer.bias is None and x.is_contiguous():
            return self.gemv(x, layer.weight, w_scale=scale)
        return layer(x)
