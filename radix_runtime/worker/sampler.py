"""Next-token sampling with per-slot state (seeded generators, penalty counts, logit bias).

Order of operations on each row's logits: logit_bias, repetition penalty (HF semantics:
divide positive / multiply negative logits of every token seen in prompt or output),
frequency and presence penalties (OpenAI semantics: over output tokens only), then greedy
argmax, or temperature -> softmax -> top_k -> top_p (on the top-k-renormalised mass) -> min_p
-> a draw.

Returned logprobs are log_softmax of the *raw* model logits, before bias, penalties and
temperature (as vLLM's default and OpenAI's API): they score the model, not the sampler, and
`select()` and prompt logprobs use the same scale.

Draws use the exponential race (argmax of p / Exp(1) noise), which equals a multinomial draw
but lets every seeded request draw its noise from its own generator inside one batched op:
a seeded request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from radix_runtime.messages import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class SlotState:
    params: SamplingParams
    generator: torch.Generator | None = None  # only when params.seed is set
    output_counts: torch.Tensor | None = None  # [V] float32, only when penalties are on
    seen: torch.Tensor | None = None  # [V] bool: prompt + output tokens fed so far
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None


@dataclass
class SampleOutput:
    next_ids: list[int]
    logprobs: list[float]  # 0.0 where not asked for
    top_ids: list[np.ndarray]  # int32 [k] per row (k = 0 where not asked for)
    top_logprobs: list[np.ndarray]  # float32 [k]


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[row, targets[row]] for [R, V] logits and [R] targets."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, targets.view(-1, 1)).view(-1)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.slots: dict[int, SlotState] = {}
        # unseeded requests draw from one generator seeded by --seed: a server run is repeatable
        self._shared_generator = torch.Generator(device=device).manual_seed(seed)

    # ------------------------------------------------------------------------------------------
    # per-slot state

    def reset_slot(
        self,
        slot: int,
        params: SamplingParams,
        history: np.ndarray | None = None,
        prior_outputs: np.ndarray | None = None,
    ) -> None:
        """`history`: tokens before the first fed one (a cached prefix); `prior_outputs`: tokens
        generated before a retraction. Both count for the penalties."""
        state = SlotState(params)
        if params.seed is not None:
            state.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if params.needs_penalties:
            state.output_counts = torch.zeros(self.vocab_size, device=self.device)
            state.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            if history is not None and len(history):
                state.seen[torch.from_numpy(history.astype(np.int64)).to(self.device)] = True
            if prior_outputs is not None and len(prior_outputs):
                ids = torch.from_numpy(prior_outputs.astype(np.int64)).to(self.device)
                state.output_counts += torch.bincount(ids, minlength=self.vocab_size)[
                    : self.vocab_size
                ].float()
        bias = {t: b for t, b in params.logit_bias.items() if 0 <= int(t) < self.vocab_size}
        if len(bias) != len(params.logit_bias):
            logger.warning("dropped logit_bias entries outside the vocabulary")
        if bias:
            state.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=self.device)
            state.bias_values = torch.tensor(list(bias.values()), device=self.device)
        self.slots[slot] = state

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def observe_fed(self, slot: int, ids: torch.Tensor) -> None:
        """Tokens fed to the model (prompt chunks, or the previous output) count as seen."""
        state = self.slots[slot]
        if state.seen is not None:
            state.seen[ids] = True

    # ------------------------------------------------------------------------------------------
    # sampling

    def sample(
        self,
        logits: torch.Tensor,
        slots: list[int],
        return_logprob: list[bool],
        top_logprobs_num: list[int],
    ) -> SampleOutput:
        """One next token per row of `logits` [B, V] (float32), row i belonging to slots[i]."""
        states = [self.slots[s] for s in slots]
        if (
            not any(return_logprob)
            and not any(top_logprobs_num)
            and all(
                st.params.greedy and st.bias_ids is None and st.output_counts is None
                for st in states
            )
        ):  # plain greedy rows (benchmarks, most tests): one argmax, no copies
            n = len(states)
            empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
            next_ids = logits.argmax(dim=-1).tolist()
            return SampleOutput(next_ids, [0.0] * n, [empty_i] * n, [empty_f] * n)
        shaped = self._apply_bias_and_penalties(logits.clone(), states)
        next_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
        greedy = [i for i, st in enumerate(states) if st.params.greedy]
        drawn = [i for i, st in enumerate(states) if not st.params.greedy]
        if greedy:
            next_ids[greedy] = shaped[greedy].argmax(dim=-1)
        if drawn:
            next_ids[drawn] = self._draw(shaped[drawn], [states[i] for i in drawn])
        self._count_outputs(next_ids, states)
        out = self._logprobs(logits, next_ids, return_logprob, top_logprobs_num)
        out.next_ids = next_ids.tolist()
        return out

    def _apply_bias_and_penalties(
        self, logits: torch.Tensor, states: list[SlotState]
    ) -> torch.Tensor:
        for i, st in enumerate(states):
            if st.bias_ids is not None:
                logits[i, st.bias_ids] += st.bias_values
        rows = [i for i, st in enumerate(states) if st.output_counts is not None]
        if not rows:
            return logits
        params = [states[i].params for i in rows]
        counts = torch.stack([states[i].output_counts for i in rows])
        seen = torch.stack([states[i].seen for i in rows])
        rep = self._column([p.repetition_penalty for p in params])
        freq = self._column([p.frequency_penalty for p in params])
        presence = self._column([p.presence_penalty for p in params])
        x = logits[rows]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - presence * (counts > 0).float()
        logits[rows] = x
        return logits

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device).view(-1, 1)

    def _draw(self, logits: torch.Tensor, states: list[SlotState]) -> torch.Tensor:
        params = [st.params for st in states]
        probs = torch.softmax(logits / self._column([p.temperature for p in params]), dim=-1)
        if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
            probs = self._top_k_top_p(probs, params)
        if any(p.min_p > 0.0 for p in params):
            min_p = self._column([p.min_p for p in params])
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self._shared_generator)
        for i, st in enumerate(states):
            if st.generator is not None:
                noise[i].exponential_(generator=st.generator)
        return (probs / noise).argmax(dim=-1)

    def _top_k_top_p(self, probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Zero the probabilities outside top-k and then outside the top-p nucleus (the top token stays)."""
        vocab = probs.shape[-1]
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ks = torch.tensor(
            [p.top_k if p.top_k > 0 else vocab for p in params], device=probs.device
        ).view(-1, 1)
        ranks = torch.arange(vocab, device=probs.device).view(1, -1)
        sorted_probs = sorted_probs.masked_fill(ranks >= ks, 0.0)
        renormed = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        mass_before = renormed.cumsum(dim=-1) - renormed
        top_p = self._column([p.top_p for p in params])
        sorted_probs = sorted_probs.masked_fill(mass_before > top_p, 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)

    def _count_outputs(self, next_ids: torch.Tensor, states: list[SlotState]) -> None:
        for i, st in enumerate(states):
            if st.output_counts is not None:
                token = next_ids[i : i + 1]
                st.output_counts.index_add_(0, token, torch.ones(1, device=token.device))
                st.seen[token] = True

    def _logprobs(
        self,
        logits: torch.Tensor,
        next_ids: torch.Tensor,
        return_logprob: list[bool],
        top_logprobs_num: list[int],
    ) -> SampleOutput:
        n = len(return_logprob)
        empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
        out = SampleOutput([], [0.0] * n, [empty_i] * n, [empty_f] * n)
        rows = [i for i in range(n) if return_logprob[i] or top_logprobs_num[i] > 0]
        if not rows:
            return out
        logp = torch.log_softmax(logits[rows].float(), dim=-1)
        chosen = logp.gather(1, next_ids[rows].view(-1, 1)).view(-1).tolist()
        k = max(top_logprobs_num[i] for i in rows)
        top_vals, top_idx = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
        top_vals, top_idx = top_vals.cpu().numpy(), top_idx.cpu().numpy().astype(np.int32)
        for j, i in enumerate(rows):
            out.logprobs[i] = chosen[j] if return_logprob[i] else 0.0
            ki = top_logprobs_num[i]
            out.top_ids[i], out.top_logprobs[i] = top_idx[j, :ki], top_vals[j, :ki]
        return out
