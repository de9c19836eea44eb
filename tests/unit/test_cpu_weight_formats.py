"""CPU weight formats (worker/cpu_quant.py, --cpu-weight-format): the int8/int4 layouts, the
flag's validation and `auto`, and the default model in every format against float32.

Tolerances (docs/decisions.md, "CPU weight formats"): on the chat prompts below, the last-row
logits of each format stay within MAX_LOGIT_DIFF of float32's (SmolLM2's logits spread over
~+-20), the top-1 token agrees on at least TOP1_AGREE of the prompt rows, int8's greedy answers
equal float32's, and every format's greedy tokens are the same with a cached prefix as without.
"""

from __future__ import annotations

import pytest
import torch

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.worker import cpu_quant
from radix_runtime.worker.loader import resolve_cpu_weight_format
from radix_runtime.worker.model_runner import ModelRunner

# ---------------------------------------------------------------------------------------------
# layouts


def test_int4_fits_hold_gguf_q4_grids_exactly():
    gen = torch.Generator().manual_seed(0)
    n, k = 16, 64
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 1e-3).half().float()  # GGUF: fp16
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1's quantizer puts the group's min at 0 and max at 15
    m = (-0.05 * torch.rand(n, k // 32, 1, generator=gen)).half().float()
    q41 = (d * q + m).reshape(n, k)
    q[..., 1] = 3  # Q4_0: the largest magnitude sits at q = 0 (-8 d); 15 need not occur
    q40 = (d * (q - 8)).reshape(n, k)
    for w, fit in ((q41, "asymmetric"), (q40, "symmetric")):
        qs, ds, ms = cpu_quant.int4_groups(w, fit)
        torch.testing.assert_close(cpu_quant.dequantize_int4(qs, ds, ms), w, rtol=0, atol=1e-6)
        # the packed layout holds the same (q, d, m)
        q2, d2, m2 = cpu_quant.unpack(cpu_quant.pack_int4(qs, ds, ms), cpu_quant.KIND_INT4)
        assert torch.equal(q2, qs.int()) and torch.equal(d2, ds.float())
        assert torch.equal(m2, ms.float())
    # a symmetric grid fitted asymmetrically is off by up to half a step: the fit matters
    qs, ds, ms = cpu_quant.int4_groups(q40, "asymmetric")
    assert (cpu_quant.dequantize_int4(qs, ds, ms) - q40).abs().max() > 1e-4


def test_int8_blocks_hold_gguf_q8_0_exactly():
    gen = torch.Generator().manual_seed(3)
    n, k = 20, 96  # rows not a multiple of a tile
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 1e-3).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q[..., 0] = 127  # Q8_0's quantizer puts the block's largest magnitude at +-127
    w = (d * q).reshape(n, k)
    qs, ds = cpu_quant.quantize_int8(w)
    torch.testing.assert_close(cpu_quant.dequantize_int8(qs, ds), w, rtol=0, atol=0)
    q2, d2, _ = cpu_quant.unpack(cpu_quant.pack_int8(qs, ds), cpu_quant.KIND_INT8)
    assert torch.equal(q2[:n], qs.int()) and torch.equal(d2[:n], ds.float())
    assert not q2[n:].any()  # the tile's padding rows


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_linear_matches_its_dequantized_weights(fmt):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=gen) * 0.05
    bias = torch.randn(96, generator=gen)
    x = torch.randn(5, 128, generator=gen)
    if fmt == "int8":
        lin = cpu_quant.Int8Linear(w, bias)
        w_eff = cpu_quant.dequantize_int8(*cpu_quant.quantize_int8(w))
    else:
        lin = cpu_quant.Int4Linear(w, bias, "asymmetric")
        w_eff = cpu_quant.dequantize_int4(*cpu_quant.int4_groups(w))
    y = lin(x.bfloat16()).float()
    ref = x.bfloat16().float() @ w_eff.T + bias
    # the activations are quantized to int8 per block of 32: ~0.4% of each block's largest value
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=3e-2)
    # a strided view (rows wider than the features, as a slice of a fused projection) reads right
    wide = torch.zeros(5, 160, dtype=torch.bfloat16)
    wide[:, :128] = x.bfloat16()
    torch.testing.assert_close(lin(wide[:, :128]).float(), y, rtol=0, atol=0)
    assert (w_eff - w).abs().max() < (0.002 if fmt == "int8" else 0.05)


# ---------------------------------------------------------------------------------------------
# the flag


@pytest.mark.parametrize(
    "changes",
    [
        {"cpu_weight_format": "int3"},
        {"cpu_weight_format": "int4", "dtype": "bfloat16"},
        {"cpu_weight_format": "bfloat16", "dtype": "float32"},
        {"cpu_weight_format": "bfloat16", "dtype": "float16"},
        {"cpu_weight_format": "float32", "dtype": "bfloat16"},
        {"cpu_weight_format": "int8", "device": "cuda"},
    ],
)
def test_flag_validation_rejects(changes):
    with pytest.raises(ValueError, match="cpu-weight-format"):
        ServerArgs(**changes).validate()


@pytest.mark.parametrize("simd", [True, False])
def test_auto_follows_the_checkpoint_and_dtype(simd, monkeypatch):
    monkeypatch.setattr(cpu_quant, "fast_kernels", lambda: simd)
    norm = {"model.layers.0.input_layernorm.weight": "F32"}
    q4 = {"model.layers.0.self_attn.q_proj.weight": "Q4_1", "model.embed_tokens.weight": "Q8_0"}
    q4_f16_head = {**q4, "model.embed_tokens.weight": "F16"}
    q8 = {"model.layers.0.self_attn.q_proj.weight": "Q8_0", **norm}
    f16 = {"model.layers.0.self_attn.q_proj.weight": "F16"}
    k4 = {"model.layers.0.mlp.down_proj.weight": "Q4_K", **q4}
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def resolve(types, device=cpu, torch_dtype=torch.float32, **flags):
        return resolve_cpu_weight_format(ServerArgs(**flags), device, torch_dtype, types)

    # the file's own grids, kept exactly, where the kernels run with SIMD
    assert resolve({**q4, **norm}) == ("int4" if simd else "float32")
    assert resolve(q8) == ("int8" if simd else "float32")
    for other in (q4_f16_head, f16, k4, {}):  # a new rounding of some matrix: float32
        assert resolve(other) == "float32"
    assert resolve(q4, dtype="float32") == "float32"  # an explicit --dtype wins
    assert resolve(q4, dtype="bfloat16") == "bfloat16"
    assert resolve(f16, dtype="bfloat16") == "bfloat16"
    assert resolve(f16, cpu_weight_format="int8") == "int8"
    assert resolve(q4, device=cuda, torch_dtype=torch.bfloat16) == "bfloat16"  # CUDA: untouched
    with pytest.raises(ValueError):
        resolve(q4, device=cuda, cpu_weight_format="int4")


# ---------------------------------------------------------------------------------------------
# the default model in every format

CHATS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "What is 12 plus 30?",
]
NEW_TOKENS = 12
MAX_LOGIT_DIFF = {"bfloat16": 1.5, "int8": 1.5, "int4": 1.5}
TOP1_AGREE = 0.9


@pytest.fixture(scope="module")
def tokenizer():
    from radix_runtime.model_source import default_gguf_path
    from radix_runtime.tokenizer import load_tokenizer

    return load_tokenizer(default_gguf_path())


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in CHATS]


_RUNNERS: dict[str, ModelRunner] = {}


def runner(fmt: str) -> ModelRunner:
    if fmt not in _RUNNERS:
        args = ServerArgs(
            max_total_tokens=1024, max_running_requests=4, device="cpu", cpu_weight_format=fmt
        )
        _RUNNERS[fmt] = ModelRunner(args)
    return _RUNNERS[fmt]


@pytest.fixture(scope="module", autouse=True)
def _free_runners():
    yield
    _RUNNERS.clear()


def generate(
    r: ModelRunner, prompt: list[int], n: int, cached: int = 0
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the prompt's logits rows, in slot 1; with `cached` > 0 the first
    `cached` prompt tokens are computed first in slot 0 and slot 1 reuses their pages."""
    pages = list(range(1, len(prompt) + n + 1))
    greedy = m.SamplingParams(temperature=0.0)
    step = 0
    if cached:
        first = m.ForwardReq(
            slot=0, input_ids=m.pack_ids(prompt[:cached]), start_pos=0,
            new_pages=m.pack_ids(pages[:cached]), new_slot=True, sampling=greedy,
        )  # fmt: skip
        r.forward(m.ForwardBatch(step=step, reqs=[first]))
        step += 1
    req = m.ForwardReq(
        slot=1, input_ids=m.pack_ids(prompt[cached:]), start_pos=cached,
        new_pages=m.pack_ids(pages), new_slot=True, sampling=greedy, prompt_logprobs=True,
    )  # fmt: skip
    res, (logits,) = r.forward_with_logits(m.ForwardBatch(step=step, reqs=[req]))
    tokens = [res.results[0].next_id]
    for i in range(1, n):
        step += 1
        dec = m.ForwardReq(slot=1, input_ids=m.pack_ids(tokens[-1:]), start_pos=len(prompt) + i - 1)
        tokens.append(r.forward(m.ForwardBatch(step=step, reqs=[dec])).results[0].next_id)
    r.forward(m.ForwardBatch(step=step + 1, reqs=[], released_slots=[0, 1]))
    return tokens, logits.float()


@pytest.fixture(scope="module")
def float32_runs(prompts):
    return [generate(runner("float32"), p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_logits_within_tolerance_of_float32(fmt, prompts, float32_runs, tokenizer):
    r = runner(fmt)
    assert r.weight_format == fmt
    assert r.dtype == (torch.bfloat16 if fmt == "bfloat16" else torch.float32)
    for prompt, (ref_tokens, ref_logits) in zip(prompts, float32_runs):
        tokens, logits = generate(r, prompt, NEW_TOKENS)
        diff = (logits[-1] - ref_logits[-1]).abs().max().item()
        agree = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        print(f"\n{fmt}: max |d logit| {diff:.3f}, top-1 agreement {agree:.3f}: "
              f"{tokenizer.decode(tokens)!r}")  # fmt: skip
        assert diff < MAX_LOGIT_DIFF[fmt]
        assert agree >= TOP1_AGREE
        if fmt == "int8":
            assert tokens == ref_tokens
    paris, _ = generate(r, prompts[0], NEW_TOKENS)
    assert "Paris" in tokenizer.decode(paris)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
def test_cached_prefix_gives_the_same_tokens(fmt, prompts):
    r = runner(fmt)
    prompt = prompts[0]
    cold, _ = generate(r, prompt, NEW_TOKENS)
    warm, _ = generate(r, prompt, NEW_TOKENS, cached=len(prompt) - 5)
    assert warm == cold
