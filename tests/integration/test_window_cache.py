"""Sliding-window models with the radix cache: greedy outputs with the cache on equal the outputs
with it off, through the real scheduler and worker (as test_cache_equivalence.py drives them),
with chunked prefill (64-token chunks) crossing the window edge (window 16) and cached prefixes
much longer than the window: Mistral (every layer windowed) and Gemma 3 (local and global)."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_cache_equivalence import prompts_sharing_prefixes, run

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs

pytestmark = pytest.mark.slow

WINDOW = 16
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=2,
    bos_token_id=1,
)


def _save(family: str, folder) -> str:
    torch.manual_seed(0)
    if family == "mistral":
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**COMMON, sliding_window=WINDOW)
        )
    else:
        cfg = transformers.Gemma3TextConfig(
            **COMMON,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )
        model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # peaked logits: greedy choices far from ties
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1)
    model.float().save_pretrained(folder, safe_serialization=True)
    return str(folder)


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
    prompts = prompts_sharing_prefixes(COMMON["vocab_size"])
    assert max(len(p) for p in prompts) > 64 + WINDOW  # chunks and hits beyond the window
    arrivals = [i // 2 * 3 for i in range(len(prompts))]
    greedy = m.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    off, _ = run(runner, base.replace(disable_radix_cache=True), prompts, greedy, arrivals)
    on, sched = run(runner, base, prompts, greedy, arrivals)
    assert on == off
    assert sched.cached_tokens_total > 200
    overlap = base.replace(disable_overlap_schedule=False)
    assert run(runner, overlap, prompts, greedy, arrivals)[0] == off
