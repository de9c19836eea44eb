"""The CUDA path's kernels, one module per family, each Triton kernel beside its torch reference:

- `gemv`: batch-1 GEMV with RMSNorm / SiLU-and-mul prologues and a residual-add epilogue (bf16
  and FP8 weights), its tuned configurations;
- `rope`: RoPE on the q and k heads of the qkv projection, with optional per-head RMSNorm;
- `kv_store`: a layer's new K and V into their pool slots (bf16 or FP8);
- `decode_attention`: split-KV decode attention for small batches over the paged pool;
- `norms`: RMSNorm, fused add + RMSNorm (FlashInfer), Gemma's norms and its norm-add-norm;
- `activation`: SiLU-and-mul, gelu(tanh)-and-mul;
- `fp8_quant`: dynamic per-token FP8 quantization of activations;
- `fp8_gemv`: the W8A8 GEMV for a few rows on FP8 tensor cores (the input quantized inside it,
  the same prologues and epilogue as `gemv`);
- `int4_gemv`: packed int4 weights (W4A16): the GEMV for decode rows and the GEMM for more.

`KernelConfig` (config.py) says which kernel runs where; `FusedOps` (ops.py) is the kernel set
a model's CUDA path calls, bound to one config. Numerics: each kernel computes in float32 and
rounds once, where the torch reference rounds to the model dtype after every op (as Hugging Face
does); the difference is within bf16 rounding.

Triton and FlashInfer are the `gpu` extra: without them every module still imports (the torch
references work), `available()` says False and the runner keeps the plain torch forward.
"""

from __future__ import annotations

from radix_runtime.worker.kernels._triton import HAVE_TRITON
from radix_runtime.worker.kernels.config import KernelConfig


def available() -> bool:
    """Whether the fused path can run: Triton and FlashInfer importable."""
    if not HAVE_TRITON:
        return False
    from radix_runtime.worker.kernels import norms

    return norms._fi_rmsnorm is not None


__all__ = ["KernelConfig", "available"]
