"""Sliding-window models with the radix cache: greedy outputs with the cache on equal the outputs
with it off, through the real scheduler and worker (as test_cache_equivalence.py drives them),
with chunked prefill (64-token chunks) crossing the window edge (window 16) and cached prefixes
much longer than the window: Mistral (every layer windowed) and Gemma 3 (local and global)."""

from __future__ import annotations

import pytest
from model_support import save_hf, tiny_hf_model
from test_cache_equivalence import prompts_sharing_prefixes, run

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs

pytestmark = pytest.mark.slow

WINDOW = 16
# peaked logits (weights ~ N(0, 0.1), norms at 1): greedy choices far from ties
PEAKED = dict(std=0.1, norm_std=0, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6)
GEMMA3 = dict(head_dim=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _save(family: str, folder) -> str:
    extra = GEMMA3 if family == "gemma3" else {}
    return save_hf(tiny_hf_model(family, **PEAKED, sliding_window=WINDOW, **extra), folder)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_windowed_greedy_cache_on_equals_off(family, page_size, tmp_path):
    from radix_runtime.worker.model_runner import ModelRunner

    base = ServerArgs(
        model=_save(family, tmp_path / family),
        page_size=page_size,
        max_total_tokens=8192,
        chunked_prefill_size=64,
        max_running_requests=8,
        device="cpu",
        dtype="float32",
        radix_tree_impl="python",
        disable_overlap_schedule=True,
    )
    runner = ModelRunner(base)
    assert runner.config.sliding_window == WINDOW
    prompts = prompts_sharing_prefixes(PEAKED["vocab_size"])
    assert max(len(p) for p in prompts) > 64 + WINDOW  # chunks and hits beyond the window
    arrivals = [i // 2 * 3 for i in range(len(prompts))]
    greedy = m.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    off, _ = run(runner, base.replace(disable_radix_cache=True), prompts, greedy, arrivals)
    on, sched = run(runner, base, prompts, greedy, arrivals)
    assert on == off
    assert sched.cached_tokens_total > 200
    overlap = base.replace(disable_overlap_schedule=False)
    assert run(runner, overlap, prompts, greedy, arrivals)[0] == off
