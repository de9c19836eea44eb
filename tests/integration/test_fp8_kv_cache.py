"""The FP8 KV cache with the radix cache: greedy outputs with the cache on equal the outputs with
it off, through the real scheduler and worker (as test_cache_equivalence.py drives them), with
chunked prefill and page sizes 1 and 16; the scheduler reports the pool's element type."""

from __future__ import annotations

import pytest
import torch
from model_support import save_hf, tiny_hf_model
from test_cache_equivalence import prompts_sharing_prefixes, run

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs

VOCAB = 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    # peaked logits (weights ~ N(0, 0.1), norms at 1): greedy choices far from ties
    model = tiny_hf_model(std=0.1, norm_std=0, vocab_size=VOCAB, num_hidden_layers=2,
                          max_position_embeddings=512, rms_norm_eps=1e-6)  # fmt: skip
    return save_hf(model, tmp_path_factory.mktemp("fp8kv"))


@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_kv_greedy_cache_on_equals_off(checkpoint, page_size):
    from radix_runtime.worker.model_runner import ModelRunner

    args = ServerArgs(
        model=checkpoint,
        page_size=page_size,
        kv_cache_dtype="fp8_e4m3",
        max_total_tokens=4096,
        chunked_prefill_size=32 if page_size == 1 else 48,
        max_running_requests=8,
        device="cpu",
        dtype="float32",
        radix_tree_impl="python",
        disable_overlap_schedule=True,
    )
    runner = ModelRunner(args)
    assert runner.kv_pool.is_fp8
    prompts = prompts_sharing_prefixes(VOCAB)
    greedy = m.SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    arrivals = [i // 2 * 3 for i in range(len(prompts))]
    off, _ = run(runner, args.replace(disable_radix_cache=True), prompts, greedy, arrivals)
    on, sched = run(runner, args, prompts, greedy, arrivals)
    assert on == off
    assert sched.cached_tokens_total > 100
    assert sched.server_info().kv_cache_dtype == "fp8_e4m3"


def test_fp8_kv_host_tier_stores_fp8_and_keeps_outputs():
    """With the host tier under an FP8 device pool: the host pages are FP8 too (the pool's dtype),
    and greedy outputs with evicted histories loaded back equal the cache-off outputs."""
    from test_hicache_equivalence import conversations

    from radix_runtime.worker.model_runner import ModelRunner

    base = ServerArgs(
        model="tiny-llama", load_format="dummy", model_config="tiny-llama", page_size=16,
        max_total_tokens=128, chunked_prefill_size=32, max_running_requests=3, device="cpu",
        disable_overlap_schedule=True, kv_cache_dtype="fp8_e4m3",
    )  # fmt: skip
    tiered = base.replace(enable_hierarchical_cache=True, hicache_ratio=8.0)
    runner = ModelRunner(tiered)
    assert runner.host_pool.buffer.dtype == torch.float8_e4m3fn
    prompts, arrivals = conversations(runner.ready_info().vocab_size)
    greedy = m.SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    off, _ = run(runner, base.replace(disable_radix_cache=True), prompts, greedy, arrivals)
    on, sched = run(runner, tiered, prompts, greedy, arrivals)
    assert on == off
    assert sched.host_cached_tokens_total > 0
