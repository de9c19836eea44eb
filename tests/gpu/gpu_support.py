"""What the GPU tests share: runners on CUDA, tiny random HF models with their bf16 runner, and
bf16-aware comparisons. The stand-in for the scheduler's page bookkeeping that drives several
runners with identical ForwardBatch messages (`Driver`, `Seq`) is tests/model_support.py's."""

from __future__ import annotations

import copy

import numpy as np
import torch
from model_support import hf_logits, save_hf, tiny_hf_model

from radix_runtime.config import ServerArgs
from radix_runtime.worker.model_runner import ModelRunner

# model_support.TINY at sizes that reach the CUDA kernels' real code paths
GPU_TINY = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, max_position_embeddings=1024
)


def cuda_runner(**overrides) -> ModelRunner:
    """tiny-llama with dummy weights on the GPU; small pool, few graphs, so it builds in ~1 s."""
    args = dict(
        model="tiny-llama",
        load_format="dummy",
        device="cuda",
        max_total_tokens=4096,
        max_running_requests=16,
        cuda_graph_max_bs=8,
    )
    args.update(overrides)
    return ModelRunner(ServerArgs(**args))


def copy_weights(dst: ModelRunner, src: ModelRunner) -> None:
    """Give `dst` the weights of `src`, cast to dst's dtype (same random model in every precision)."""
    src_params = dict(src.model.named_parameters())
    with torch.no_grad():
        for name, p in dst.model.named_parameters():
            p.copy_(src_params[name].to(p.dtype))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def greedy_agrees(got: torch.Tensor, ref: torch.Tensor, slack: float) -> bool:
    """Same argmax on every row whose top-2 margin in `ref` exceeds `slack` (closer calls may
    flip under bf16 rounding without anything being wrong)."""
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > slack
    return bool((got.argmax(-1) == ref.argmax(-1))[decisive].all())


def random_ids(n: int, seed: int, vocab: int = 1024) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, vocab, size=n)]


def hf_and_runner(arch: str, folder, runner_args: dict, **config):
    """A tiny random `arch` model (GPU_TINY + `config`) saved in `folder`: transformers in float32
    (the reference) and in bf16 (same weights, rounded) on the GPU, and our runner on the
    checkpoint (bf16, FlashInfer, CUDA graphs) built with `runner_args`."""
    model = tiny_hf_model(arch, std=0.05, bias_std=0.1, **GPU_TINY, **config)
    path = save_hf(model, folder)
    hf16 = copy.deepcopy(model).to(device="cuda", dtype=torch.bfloat16)
    hf32 = model.cuda()
    runner = ModelRunner(ServerArgs(model=path, device="cuda", **runner_args))
    assert runner.dtype == torch.bfloat16 and runner.attn.name == "flashinfer"
    assert runner.cuda_graphs is not None
    return hf32, hf16, runner


def check_against_hf(ours: torch.Tensor, hf32, hf16, ids: list[int], rows: slice) -> None:
    """`ours` (bf16 logits of `rows` of `ids`) lands about as close to HF float32 as HF bf16
    does, and picks the same greedy token wherever the choice is clear."""
    ref, base = hf_logits(hf32, ids)[rows], hf_logits(hf16, ids)[rows]
    err, err_hf16 = rel_err(ours, ref), rel_err(base, ref)
    assert err < 2 * err_hf16 + 5e-3, f"ours {err:.2e}, HF bf16 {err_hf16:.2e}"
    assert greedy_agrees(ours, ref, 0.1)
