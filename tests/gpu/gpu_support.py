"""What the GPU tests share: runners on CUDA, a stand-in for the scheduler's page bookkeeping that
drives several runners with identical ForwardBatch messages, and bf16-aware comparisons."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.worker.model_runner import ModelRunner

GREEDY = m.SamplingParams(temperature=0.0)


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


@dataclass
class Seq:
    slot: int
    pages: list[int] = field(default_factory=list)
    sent_pages: int = 0  # pages the workers already have in this slot's row
    cached: int = 0  # tokens whose KV is in the pool
    opened: bool = False


class Driver:
    """Hands out pages like the scheduler would and sends every batch to all runners."""

    def __init__(self, runners: list[ModelRunner]) -> None:
        self.runners = runners
        self.page_size = runners[0].page_size
        self.next_page = 1  # page 0 is reserved
        self.step_no = 0

    def alloc(self, n: int) -> list[int]:
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return pages

    def req(
        self, seq: Seq, ids: list[int], sample: bool = True, prompt_logprobs: bool = True
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
        )
        seq.sent_pages, seq.cached, seq.opened = len(seq.pages), seq.cached + len(ids), True
        return r

    def share_prefix(self, seq: Seq, source: Seq, tokens: int) -> None:
        """`seq` starts with the first `tokens` (page-aligned) tokens of `source` already cached."""
        assert tokens % self.page_size == 0 and not seq.opened
        seq.pages = source.pages[: tokens // self.page_size]
        seq.cached = tokens

    def step(self, reqs: list[m.ForwardReq]) -> list[tuple[list, list[torch.Tensor | None]]]:
        """One ForwardBatch (through the msgpack codec, as on the wire) to every runner."""
        self.step_no += 1
        frame = m.encode(m.ForwardBatch(step=self.step_no, reqs=reqs))
        outs = []
        for runner in self.runners:
            result, logits = runner.forward_with_logits(m.decode(frame))
            assert len(result.results) == len(reqs)
            outs.append(
                (result.results, [x.float().cpu() if x is not None else None for x in logits])
            )
        return outs


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
