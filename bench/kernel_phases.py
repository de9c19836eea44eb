"""Which phase of a forward step a GPU kernel belongs to, from its name: how bench/gpu_worker.py
splits a step's GPU time (matmuls, attention, KV store, RoPE, norms and activations, embedding,
sampling, copies). Torch-free, so the table is tested on the CPU."""

from __future__ import annotations

import re

# first match wins; names as torch.profiler reports them (Triton kernels by their function name)
PHASES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (phase, re.compile(pattern, re.IGNORECASE))
    for phase, pattern in (
        ("kv_store", r"store_kv|index_put|scatter|append_paged_kv|appendpagedkv"),
        ("attention", r"decode_split|decode_merge|batchdecode|batchprefill|mergestate|attention"
         r"|flash_?attn|flash_fwd|fmha|paged_kv|single_decode|single_prefill"
         r"|prefillwith|decodewith"),  # FA3's PrefillWithKVCacheKernel ("fill": not a copy)
        ("rope", r"rotary|rope"),
        ("sampling", r"argmax|softmax|topk|top_k|top_p|sort|multinomial|sampling|exponential"
         r"|log_softmax|penalt|gumbel"),
        ("matmul", r"gemv|gemm|cutlass|nvjet|xmma|cublas|splitk|wgmma|matmul|_mm_"),
        ("norm_act", r"norm|silu|gelu|act_and_mul|and_mul"),
        ("embedding", r"indexselect|embedding"),
        ("copy", r"copy|cat_?array|fill|memcpy|memset"),
    )
)  # fmt: skip


def kernel_phase(name: str) -> str:
    for phase, pattern in PHASES:
        if pattern.search(name):
            return phase
    return "other"


def phase_breakdown(kernels: list[dict]) -> dict[str, float]:
    """Microseconds per phase (largest first) of kernels given as {"name", "us"} rows."""
    out: dict[str, float] = {}
    for k in kernels:
        phase = kernel_phase(k["name"])
        out[phase] = out.get(phase, 0.0) + k["us"]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
