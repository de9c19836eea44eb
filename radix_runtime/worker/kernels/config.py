"""KernelConfig: which kernel runs where on the CUDA path, chosen once per runner.

The defaults are what serving runs (each choice measured on the H200, docs/decisions.md);
benchmarks build variants by passing a different config (`ModelRunner(args, kernels=...)` or
`runner.use_kernels(...)`), never by changing module state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radix_runtime.worker.kernels._triton import pdl_supported
from radix_runtime.worker.kernels.gemv import GemvTable, default_gemv_configs


@dataclass(frozen=True)
class KernelConfig:
    # a one-token step runs the fused-GEMV layer path (norms, residual adds and SiLU-and-mul in
    # the GEMVs' prologues/epilogues: models/llama.py `_forward_row`)
    row_fusion: bool = True
    # single-row projections (and the LM head) use the Triton GEMV instead of cuBLAS
    triton_gemv: bool = True
    # decode-only batches of <= this many requests use the Triton split-KV attention instead of
    # FlashInfer's decode (0: never)
    triton_decode_max_bs: int = 8
    # (BLOCK_N, BLOCK_K, num_warps) of the GEMV per (rows, cols, prologue, add): the H200's
    # table, updated from the sweep named by $RADIX_RUNTIME_GEMV_CONFIGS
    gemv_configs: GemvTable = field(default_factory=default_gemv_configs)
    # int4 weights (AWQ / GPTQ checkpoints, --quantization int4) stay packed on the GPU:
    # projections of up to int4_gemv_max_rows rows run the Triton int4 GEMV, up to
    # int4_gemm_max_rows the int4 GEMM (each weight tile read once for all rows), more rows
    # (prefill chunks) dequantize the weight per call and run cuBLAS; False: dequantized to the
    # model dtype at load. By rows on gate_up (docs/results/h200_quant_kernels.json, by_rows):
    # the GEMV 29 / 49 / 88 us at 1 / 2 / 4 rows, the GEMM 306-334 us at 1-8 rows, cuBLAS on
    # bf16 weights 59 us: the GEMM for a few rows is the slow part left
    int4_gemv: bool = True
    int4_gemv_max_rows: int = 4
    int4_gemm_max_rows: int = 256
    # projections of 2..int4_rows_max_rows rows run the int4 GEMV for a few rows at once (each
    # weight block made floats once for 2 or 4 rows) before the thresholds above; 0: off. On
    # gate_up (docs/results/h200_quant_kernels.json, by_rows) it beats the one-row GEMV and the
    # GEMM at 2 / 4 / 8 / 16 rows (39 / 82 / 154 / 299 us against 49 / 88 / 166 us and 334 / 370
    # us) and loses to the GEMM at 64 (1,129 against 526 us)
    int4_rows_max_rows: int = 16
    # (BLOCK_Q, BLOCK_KW, num_warps[, prefetch]) of the int4 GEMV for every shape (None:
    # kernels/int4_gemv.py's INT4_GEMV_CONFIGS table, then its default)
    int4_gemv_config: tuple[int, ...] | None = None
    # the one-token path's Triton kernels (GEMVs, RoPE, KV store, split-KV attention, Gemma's
    # norms) launch with programmatic dependent launch where the GPU and Triton support it
    # (kernels/_triton.py `pdl_supported`): each starts while the kernel before it finishes and
    # waits for its writes in the kernel, a GEMV streaming its first weight block meanwhile.
    # Batch-1 decode on the H200, off -> on (docs/results/h200_decode_levers.json): Llama-3.1-8B
    # bf16 4.15 -> 3.92 ms, FP8 3.01 -> 2.79, int4 2.69 -> 2.55, Qwen3-8B 4.39 -> 4.13,
    # Gemma-3-12B 7.39 -> 6.32; the same tokens
    pdl: bool = True
    # FP8 (W8A8) projections of 1..fp8_mma_max_rows rows and at least fp8_mma_min_n output rows
    # run kernels/fp8_gemv.py's tensor-core GEMV (input rows quantized to e4m3 per row inside it,
    # the norm / SiLU / GELU prologues and residual adds fused as in the bf16 GEMV) instead of
    # the W8A16 GEMV at one row and per-token quantization + torch._scaled_mm beyond (0: off).
    # On the H200 it wins on wide products only (docs/results/h200_quant_fp8_mma.json, us per
    # product, W8A16 in brackets): gate_up 28672x4096 33.8 (41.3), an FP8 LM head 128256x4096
    # 126 (195; bf16 237); with 4,096 output rows its 64 programs of 64 rows (the tensor-core
    # tile) leave half the SMs idle: o 10.3 (7.1), down 34.2 (22.8). Batch-1 decode of the 8B
    # shape: 2.778 ms against 2.792 with it off (FP8 LM head: 2.676 against 2.692)
    fp8_mma_max_rows: int = 16
    fp8_mma_min_n: int = 16384

    def use_pdl(self) -> bool:
        """`pdl`, where this process's GPU and Triton support it."""
        return self.pdl and pdl_supported()
