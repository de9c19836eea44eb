"""The embedded SmolLM2-135M-Instruct GGUF: our loader + model against transformers' own GGUF path.

Checks greedy tokens and prompt logits, and prints (not asserts) the GGUF load time with a cold
and a warm conversion cache, and batch-1 decode tok/s of our runner vs HF `generate`.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.model_source import ModelNotFound, default_gguf_path
from radix_runtime.worker import loader
from radix_runtime.worker.model_runner import ModelRunner

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
BENCH_TOKENS = 32
PAGE_SIZE = 16
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return default_gguf_path()
    except ModelNotFound as exc:
        pytest.skip(str(exc))


def _hf_model(folder: str, name: str):
    """transformers' GGUF loading (needs accelerate); else its GGUF converter into LlamaForCausalLM."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ImportError, ValueError) as exc:
        print(f"\nAutoModelForCausalLM(gguf_file=...) failed ({exc}); using load_gguf_checkpoint")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = LlamaForCausalLM(AutoConfig.from_pretrained(folder, gguf_file=name)).float()
    state = load_gguf_checkpoint(
        os.path.join(folder, name), return_tensors=True, model_to_load=model
    )
    model.load_state_dict(state["tensors"], strict=False)
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def hf(gguf_path):
    from transformers import AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return tokenizer, _hf_model(folder, name).eval()


@pytest.fixture(scope="module")
def runner(gguf_path, tmp_path_factory):
    """Loads twice into a fresh conversion cache: the first load converts, the second hits."""
    args = ServerArgs(
        max_total_tokens=2048,
        page_size=PAGE_SIZE,
        max_running_requests=4,
        device="cpu",
        cpu_weight_format="float32",  # compared with transformers' float32 model
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(loader.CACHE_ENV, str(tmp_path_factory.mktemp("gguf_cache")))
        cold = ModelRunner(args)
        warm = ModelRunner(args)
    print(f"\nGGUF load: first (convert + cache) {cold.load_s:.2f}s, cached {warm.load_s:.2f}s")
    del cold
    return warm


@pytest.fixture(scope="module")
def prompt(hf) -> list[int]:
    tokenizer, _ = hf
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy_generate(
    runner: ModelRunner, prompt: list[int], n: int
) -> tuple[list[int], torch.Tensor, float]:
    """(new tokens, prefill logits, decode seconds) through real ForwardBatch steps in slot 0."""
    total = len(prompt) + n
    pages = list(range(1, math.ceil(total / PAGE_SIZE) + 1))
    first = m.ForwardReq(
        slot=0,
        input_ids=m.pack_ids(prompt),
        start_pos=0,
        new_pages=m.pack_ids(pages),
        new_slot=True,
        sampling=m.SamplingParams(temperature=0.0),
        prompt_logprobs=True,
    )
    result, (logits,) = runner.forward_with_logits(m.ForwardBatch(step=0, reqs=[first]))
    tokens = [result.results[0].next_id]
    t0 = time.perf_counter()
    for step in range(1, n):
        req = m.ForwardReq(
            slot=0, input_ids=m.pack_ids(tokens[-1:]), start_pos=len(prompt) + step - 1
        )
        tokens.append(runner.forward(m.ForwardBatch(step=step, reqs=[req])).results[0].next_id)
    return tokens, logits, time.perf_counter() - t0


def test_greedy_tokens_and_logits_match_transformers(runner, hf, prompt):
    tokenizer, model = hf
    ours, logits, _ = greedy_generate(runner, prompt, NEW_TOKENS)
    with torch.no_grad():
        ref_logits = model(torch.tensor([prompt])).logits[0]
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
    diff = (logits - ref_logits).abs().max().item()
    print(
        f"\nours: {tokenizer.decode(ours)!r}\nhf:   {tokenizer.decode(ref)!r}\nmax |logit diff| {diff:.2e}"
    )
    assert ours == ref
    assert diff < 1e-2
    assert "Paris" in tokenizer.decode(ours)
    assert runner.ready_info().eos_token_ids == [2]


def test_decode_speed_vs_transformers(runner, hf, prompt):
    """Batch-1 decode tok/s, printed for the report (not asserted)."""
    _, model = hf
    greedy_generate(runner, prompt, 4)  # warm-up
    _, _, ours_s = greedy_generate(runner, prompt, BENCH_TOKENS + 1)

    def hf_generate_s(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        return time.perf_counter() - t0

    hf_generate_s(4)  # warm-up
    hf_s = hf_generate_s(BENCH_TOKENS + 1) - hf_generate_s(1)
    print(
        f"\nbatch-1 decode on {torch.get_num_threads()} CPU threads: ours "
        f"{BENCH_TOKENS / ours_s:.1f} tok/s, HF generate {BENCH_TOKENS / hf_s:.1f} tok/s"
    )
