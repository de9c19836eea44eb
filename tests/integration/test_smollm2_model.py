"""The embedded SmolLM2-135M-Instruct GGUF: our loader + model against transformers' own GGUF path.

Checks greedy tokens and prompt logits, a long greedy decode (EOS ignored) token by token against
transformers' own logits, and that a second load reads the conversion cache instead of converting
again. Decode speed against HF `generate` is a benchmark, not a test: bench/cpu_decode.py.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.model_source import ModelNotFound, default_gguf_path
from radix_runtime.worker import loader
from radix_runtime.worker.model_runner import ModelRunner

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
DECODE_TOKENS = 32
LOGIT_TIE = 1e-2  # the prompt logits agree within this (see the first test)
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

    if importlib.util.find_spec("accelerate") is not None:  # else it refuses, after a GGUF read
        try:
            return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except (ImportError, ValueError) as exc:
            print(
                f"\nAutoModelForCausalLM(gguf_file=...) failed ({exc}); using load_gguf_checkpoint"
            )
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


def _cache_files(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def loads(gguf_path, tmp_path_factory):
    """Loads twice into a fresh conversion cache: (warm runner, cache files after the first load
    with their mtimes, the same after the second)."""
    args = ServerArgs(
        max_total_tokens=2048,
        page_size=PAGE_SIZE,
        max_running_requests=4,
        device="cpu",
        cpu_weight_format="float32",  # compared with transformers' float32 model
    )
    cache = tmp_path_factory.mktemp("gguf_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(loader.CACHE_ENV, str(cache))
        cold = ModelRunner(args)
        after_cold = _cache_files(cache)
        warm = ModelRunner(args)
        after_warm = _cache_files(cache)
    del cold
    return warm, after_cold, after_warm


@pytest.fixture(scope="module")
def runner(loads):
    return loads[0]


@pytest.fixture(scope="module")
def prompt(hf) -> list[int]:
    tokenizer, _ = hf
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy_generate(
    runner: ModelRunner, prompt: list[int], n: int
) -> tuple[list[int], torch.Tensor]:
    """(new tokens, prefill logits) through real ForwardBatch steps in slot 0, EOS ignored."""
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
    for step in range(1, n):
        req = m.ForwardReq(
            slot=0, input_ids=m.pack_ids(tokens[-1:]), start_pos=len(prompt) + step - 1
        )
        tokens.append(runner.forward(m.ForwardBatch(step=step, reqs=[req])).results[0].next_id)
    return tokens, logits


def test_greedy_tokens_and_logits_match_transformers(runner, hf, prompt):
    tokenizer, model = hf
    ours, logits = greedy_generate(runner, prompt, NEW_TOKENS)
    with torch.no_grad():
        ref_logits = model(torch.tensor([prompt])).logits[0]
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
    diff = (logits - ref_logits).abs().max().item()
    assert ours == ref, f"ours {tokenizer.decode(ours)!r} != hf {tokenizer.decode(ref)!r}"
    assert diff < 1e-2
    assert "Paris" in tokenizer.decode(ours)
    assert runner.ready_info().eos_token_ids == [2]


def test_the_second_load_reads_the_conversion_cache(loads):
    _, after_cold, after_warm = loads
    assert any(name.endswith(".safetensors") for name in after_cold), after_cold
    assert after_warm == after_cold  # nothing converted or rewritten by the second load


def test_long_greedy_decode_follows_transformers_logits(runner, hf, prompt):
    """DECODE_TOKENS greedy decode steps with EOS ignored (past the answer, where the model's top
    two logits can nearly tie): each of our tokens must be transformers' argmax at its position
    (teacher-forced on our own tokens) or within LOGIT_TIE of it."""
    _, model = hf
    ours, _ = greedy_generate(runner, prompt, DECODE_TOKENS)
    assert len(ours) == DECODE_TOKENS
    with torch.no_grad():
        ref_logits = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]
    chosen = ref_logits[torch.arange(DECODE_TOKENS), torch.tensor(ours)]
    shortfall = ref_logits.max(dim=-1).values - chosen
    assert shortfall.max().item() <= LOGIT_TIE, shortfall.tolist()
