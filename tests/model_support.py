"""What the tests that drive a real ModelRunner share (the CPU ones in tests/unit and
tests/integration; the CUDA ones in tests/gpu through gpu_support.py):

- `tiny_hf_model(arch, **config)`: a random Hugging Face model built in the test (no hub) from
  TINY plus `config`, every weight perturbed so that each one matters (transformers initialises
  norms to 1 and biases to 0); `save_hf` writes it with `save_pretrained` (safetensors) for our
  loader; `hf_logits` runs it on one sequence.
- `Driver` + `Seq`: a stand-in for the scheduler's page bookkeeping that sends each ForwardBatch,
  through the wire codec, to every runner it drives.
- `float32_runner`, `PROMPT`, `assert_logits_close`: the float32 CPU comparisons against
  transformers (RADIX_RUNTIME_TEST_DEVICE=cuda runs our side of them on a GPU).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs

# a 3-layer GQA model with 16-wide heads: small enough to build and compare in a fraction of a second
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    eos_token_id=2,
    bos_token_id=1,
)
VOCAB = TINY["vocab_size"]
PROMPT = [int(x) for x in np.random.default_rng(0).integers(3, VOCAB, size=45)]
ATOL = 1e-4
DEVICE = os.environ.get("RADIX_RUNTIME_TEST_DEVICE", "cpu")
GREEDY = m.SamplingParams(temperature=0.0)

# arch -> (config class, model class) in transformers
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def tiny_hf_model(
    arch: str = "llama",
    *,
    seed: int = 0,
    std: float = 0.08,
    bias_std: float | None = None,
    norm_std: float = 0.1,
    **config,
):
    """A float32 `arch` model of TINY's sizes overridden by `config`, seeded with `seed`.
    Weights ~ N(0, std), biases ~ N(0, bias_std or std), norms 1 + N(0, norm_std) (0: left at 1)."""
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in ARCHS[arch])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **config})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                if norm_std:
                    p.add_(norm_std * torch.randn_like(p))
            elif name.endswith(".bias") and bias_std is not None:
                p.normal_(0.0, bias_std)
            else:
                p.normal_(0.0, std)
    return model


def save_hf(model, folder) -> str:
    """`model` as a safetensors checkpoint in `folder` (what `load_format auto` reads)."""
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits for every position of `ids`, on the CPU."""
    with torch.no_grad():
        return model(torch.tensor([ids], device=model.device)).logits[0].float().cpu()


def gguf_writer(model, path: str, arch: str, tokens: list[str]):
    """A gguf.GGUFWriter for `model` (a transformers model) with the header fields llama.cpp's
    converter writes for every architecture; the caller adds the rest and its tensors, then
    calls `finish_gguf`."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_token_list(tokens)
    w.add_eos_token_id(c.eos_token_id)
    return w


def finish_gguf(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def float32_runner(folder: str, page_size: int, device: str = DEVICE):
    from radix_runtime.worker.model_runner import ModelRunner

    args = ServerArgs(model=folder, page_size=page_size, max_total_tokens=2048,
                      max_running_requests=8, device=device, dtype="float32")  # fmt: skip
    return ModelRunner(args)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    ours = ours.cpu()
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < atol, f"max abs diff {diff}"


@dataclass
class Seq:
    slot: int
    pages: list[int] = field(default_factory=list)
    sent_pages: int = 0  # pages the workers already have in this slot's row
    cached: int = 0  # tokens whose KV is in the pool
    opened: bool = False


class Driver:
    """Hands out pages like the scheduler would and sends every batch to all runners."""

    def __init__(self, runners) -> None:
        """`runners`: one ModelRunner or a list of them."""
        self.runners = list(runners) if isinstance(runners, list | tuple) else [runners]
        self.page_size = self.runners[0].page_size
        self.next_page = 1  # page 0 is reserved
        self.step_no = 0

    def alloc(self, n: int) -> list[int]:
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return pages

    def req(
        self,
        seq: Seq,
        ids: list[int],
        sample: bool = True,
        prompt_logprobs: bool = True,
        next_token: int = -1,
    ) -> m.ForwardReq:
        need = math.ceil((seq.cached + len(ids)) / self.page_size)
        seq.pages += self.alloc(need - len(seq.pages))
        r = m.ForwardReq(
            slot=seq.slot,
            input_ids=m.pack_ids(ids),
            start_pos=seq.cached,
            page_offset=seq.sent_pages,
            new_pages=m.pack_ids(seq.pages[seq.sent_pages :]),
            new_slot=not seq.opened,
            sample=sample,
            sampling=None if seq.opened else GREEDY,
            prompt_logprobs=prompt_logprobs,
            next_token=next_token,
        )
        seq.sent_pages, seq.cached, seq.opened = len(seq.pages), seq.cached + len(ids), True
        return r

    def share_prefix(self, seq: Seq, source: Seq, tokens: int) -> None:
        """`seq` starts with the first `tokens` (page-aligned) tokens of `source` already cached."""
        assert tokens % self.page_size == 0 and not seq.opened
        seq.pages = source.pages[: tokens // self.page_size]
        seq.cached = tokens

    def step(self, reqs: list[m.ForwardReq]) -> list[tuple[list, list[torch.Tensor | None]]]:
        """One ForwardBatch (through the msgpack codec, as on the wire) to every runner: each
        runner's (results, logits per request, float32 on the CPU)."""
        self.step_no += 1
        frame = m.encode(m.ForwardBatch(step=self.step_no, reqs=reqs))
        outs = []
        for runner in self.runners:
            result, logits = runner.forward_with_logits(m.decode(frame))
            assert result.step == self.step_no and len(result.results) == len(reqs)
            outs.append(
                (result.results, [x.float().cpu() if x is not None else None for x in logits])
            )
        return outs

    def forward(self, reqs: list[m.ForwardReq]) -> tuple[list, list[torch.Tensor | None]]:
        """`step` for a Driver of one runner: its (results, logits)."""
        [out] = self.step(reqs)
        return out
