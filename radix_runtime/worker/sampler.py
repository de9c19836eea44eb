"""Next-token sampling with per-slot state (seeded generators, penalty counts, logit bias).

Order of operations on each row's logits: the constraints (a grammar's token mask; EOS and stop
ids masked until min_tokens outputs), logit_bias, repetition penalty (HF semantics:
divide positive / multiply negative logits of every token seen in prompt or output),
frequency and presence penalties (OpenAI semantics: over output tokens only), then greedy
argmax, or temperature -> softmax -> top_k -> top_p (on the top-k-renormalised mass) -> min_p
-> a draw.

Returned logprobs are log_softmax of the *raw* model logits, before bias, penalties and
temperature (as vLLM's default and OpenAI's API): they score the model, not the sampler, and
`select()` and prompt logprobs use the same scale. The constraints are the exception: a
constrained row's logprobs are those of the masked (renormalised) distribution.

Draws use the exponential race (argmax of p / Exp(1) noise), which equals a multinomial draw
but lets every seeded request draw its noise from its own generator inside one batched op:
a seeded request gives the same tokens whatever else is in the batch.

`sample_on_device` enqueues everything and returns device tensors (no host sync on CUDA: index
lists go up through pinned memory, nothing is read back), so the runner can queue the next
step before this one's tokens are known; `sample` is the same plus the read-back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from radix_runtime.messages import SamplingParams
from radix_runtime.worker.host_copy import to_device

if TYPE_CHECKING:
    from radix_runtime.grammar.compiler import GrammarCache
    from radix_runtime.grammar.matcher import SlotGrammar

logger = logging.getLogger(__name__)


@dataclass
class SlotState:
    params: SamplingParams
    generator: torch.Generator | None = None  # only when params.seed is set
    output_counts: torch.Tensor | None = None  # [V] float32, only when penalties are on
    seen: torch.Tensor | None = None  # [V] bool: prompt + output tokens fed so far
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    sampled: bool = False  # a token was sampled since the slot opened (from_last_sample feeds it)
    grammar: SlotGrammar | None = None  # the request's grammar state (constrained decoding)
    outputs: int = 0  # tokens generated so far (before a retraction too): for min_tokens


@dataclass
class SampleOutput:
    next_ids: list[int]
    logprobs: list[float]  # 0.0 where not asked for
    top_ids: list[np.ndarray]  # int32 [k] per row (k = 0 where not asked for)
    top_logprobs: list[np.ndarray]  # float32 [k]


@dataclass
class DeviceSample:
    """What `sample_on_device` enqueued: device tensors, valid once the stream reaches them."""

    next_ids: torch.Tensor  # [B] int64
    return_logprob: list[bool]
    top_logprobs_num: list[int]
    lp_rows: list[int]  # rows that asked for a logprob or top logprobs
    chosen: torch.Tensor | None = None  # [len(lp_rows)] float32: logprob of the sampled token
    top_vals: torch.Tensor | None = None  # [len(lp_rows), k] float32
    top_idx: torch.Tensor | None = None  # [len(lp_rows), k] int64

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the host needs, in the order `to_host` takes them back."""
        if not self.lp_rows:
            return [self.next_ids]
        return [self.next_ids, self.chosen, self.top_vals, self.top_idx]

    def to_host(self, host: list[torch.Tensor]) -> SampleOutput:
        """`host`: `tensors()` copied to the host (after the copies completed)."""
        n = len(self.return_logprob)
        empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)
        out = SampleOutput(host[0].tolist(), [0.0] * n, [empty_i] * n, [empty_f] * n)
        if not self.lp_rows:
            return out
        chosen = host[1].tolist()
        top_vals, top_idx = host[2].numpy(), host[3].numpy().astype(np.int32)
        for j, i in enumerate(self.lp_rows):
            out.logprobs[i] = chosen[j] if self.return_logprob[i] else 0.0
            ki = self.top_logprobs_num[i]
            out.top_ids[i], out.top_logprobs[i] = top_idx[j, :ki], top_vals[j, :ki]
        return out


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[row, targets[row]] for [R, V] logits and [R] targets."""
    return torch.log_softmax(logits.float(), dim=-1).gather(1, targets.view(-1, 1)).view(-1)


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        seed: int,
        eos_token_ids: list[int] = (),
        grammars: GrammarCache | None = None,
        jump_forward: bool = False,
        fill_threads: int = 0,
    ) -> None:
        self.vocab_size = vocab_size
        # threads filling a batch's grammar masks (xgrammar's BatchGrammarMatcher); 0: one
        # matcher after another on the step's thread
        self.fill_threads = fill_threads
        self._batch_masks = None
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.grammars = grammars  # None: constrained decoding is not available
        self.jump_forward = jump_forward and grammars is not None
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
        state.outputs = 0 if prior_outputs is None else len(prior_outputs)
        if params.grammar is not None:
            from radix_runtime.grammar.matcher import SlotGrammar

            if self.grammars is None:
                raise ValueError("a constrained request, but this worker has no grammar backend")
            state.grammar = SlotGrammar(self.grammars.get(*params.grammar), prior_outputs)
        if params.seed is not None:
            state.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if params.needs_penalties:
            state.output_counts = torch.zeros(self.vocab_size, device=self.device)
            state.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            if history is not None and len(history):
                state.seen.index_fill_(0, to_device(history, torch.long, self.device), True)
            if prior_outputs is not None and len(prior_outputs):
                ids = to_device(prior_outputs, torch.long, self.device)
                state.output_counts += torch.bincount(ids, minlength=self.vocab_size)[
                    : self.vocab_size
                ].float()
        bias = {t: b for t, b in params.logit_bias.items() if 0 <= int(t) < self.vocab_size}
        if len(bias) != len(params.logit_bias):
            logger.warning("dropped logit_bias entries outside the vocabulary")
        if bias:
            state.bias_ids = to_device(list(bias), torch.long, self.device)
            state.bias_values = to_device(list(bias.values()), torch.float32, self.device)
        self.slots[slot] = state

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def observe_fed(self, slot: int, ids: torch.Tensor) -> None:
        """Tokens fed to the model (prompt chunks, or the previous output) count as seen."""
        state = self.slots[slot]
        if state.seen is not None:
            state.seen.index_fill_(0, ids, True)  # `seen[ids] = True` would sync (a host scalar)

    # ------------------------------------------------------------------------------------------
    # constraints: grammar masks and min_tokens

    def has_grammar(self, slots: list[int]) -> bool:
        """Whether a slot's next token is constrained by a grammar (its mask needs the slot's
        previous token on the host)."""
        return any(
            (g := self.slots[s].grammar) is not None and not g.finished
            for s in slots
            if s in self.slots
        )

    def constrained(self, slots: list[int]) -> bool:
        return any(
            (st := self.slots[s]).grammar is not None or st.outputs < st.params.min_tokens
            for s in slots
        )

    def apply_constraints(self, logits: torch.Tensor, slots: list[int]) -> None:
        """Mask `logits` [B, V] in place: a grammar's disallowed tokens, and the EOS and stop ids
        of rows that have generated fewer than min_tokens (a grammar that can only stop wins)."""
        states = [self.slots[s] for s in slots]
        grammars = [st.grammar for st in states]
        masks = self.grammar_masks(slots, pinned=logits.is_cuda)
        # min_tokens: a grammar's rows have their stop ids cleared from the grammar's mask
        stop_rows = [
            i
            for i, st in enumerate(states)
            if grammars[i] is None and st.outputs < st.params.min_tokens
        ]
        if masks is not None:
            import xgrammar as xgr  # a constrained slot exists: the backend loaded it

            from radix_runtime.grammar.matcher import clear_tokens

            bitmask, rows = masks
            n = self._batch_masks.vocab_size  # the tokenizer's ids (the mask's columns)
            for i in rows:
                if states[i].outputs < states[i].params.min_tokens:
                    clear_tokens(bitmask[i], self._stop_ids(states[i].params))
            if logits.is_cuda:
                # queued behind the forward, from pinned memory: the host does not wait for the
                # device; one kernel over the batch (unconstrained rows allow every token)
                device_mask = bitmask.to(logits.device, non_blocking=True)
                xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=n)
            else:
                xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=n, indices=rows)
            if n < logits.shape[-1]:  # columns without a token (a padded vocabulary)
                if len(rows) == len(slots):
                    logits[:, n:] = float("-inf")
                else:
                    logits[self._index(rows), n:] = float("-inf")
        for i in stop_rows:
            ids = [t for t in self._stop_ids(states[i].params) if 0 <= t < self.vocab_size]
            if ids:
                logits[i].index_fill_(0, to_device(ids, torch.long, self.device), float("-inf"))

    def grammar_masks(
        self, slots: list[int], pinned: bool = False
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The grammar masks of a batch (row i: slots[i]) once each slot's pending token is
        accepted: (int32 bitmask [B, ceil(V/32)], the rows to mask), None without any; the
        host's whole share of constrained decoding in a step (bench/grammar_host.py times it)."""
        grammars = [self.slots[s].grammar for s in slots]
        if all(g is None for g in grammars):
            return None
        if self._batch_masks is None:
            from radix_runtime.grammar.matcher import BatchMasks

            # over the tokenizer's ids (the grammars' vocabulary), at most the logits' columns
            self._batch_masks = BatchMasks(self.grammars.info.vocab_size, self.fill_threads)
        return self._batch_masks.fill(grammars, pinned)

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        return list(dict.fromkeys([*self.eos_token_ids, *params.stop_token_ids]))

    def note_sampled(
        self,
        slots: list[int],
        step: int,
        host_ids: torch.Tensor,
        event: torch.cuda.Event | None,
    ) -> None:
        """Each slot sampled row i of `host_ids` (the step's sampled ids, on or on their way to
        the host) in `step`: count it, and have its grammar accept it before its next mask."""
        for i, slot in enumerate(slots):
            st = self.slots[slot]
            st.sampled = True
            st.outputs += 1
            if st.grammar is not None and not st.grammar.finished:
                st.grammar.set_pending(step, host_ids, i, event)

    def resolve_step(self, slots: list[int], step: int) -> None:
        """Accept the tokens `slots` sampled in `step` into their grammars, all at once."""
        states = [self.slots.get(s) for s in slots]
        grammars = [st.grammar for st in states if st is not None and st.grammar is not None]
        if grammars:
            from radix_runtime.grammar.matcher import resolve_all

            resolve_all(grammars, step)

    def grammar_status(
        self, slot: int, step: int, jump: bool = False
    ) -> tuple[bool, str | None, int | None, list[int]]:
        """(finished, error, replacement, jump-forward tokens) of a slot's grammar once the token
        it sampled in `step` is in; with `jump` (and --enable-jump-forward) the tokens the
        grammar forces next are appended (accepted by the matcher, counted as outputs), the
        boundary re-tokenized: `replacement` is the token that takes the sampled one's place
        (None: it stays). Penalised slots keep their sampled token (their counts have it)."""
        st = self.slots.get(slot)
        if st is None or st.grammar is None:
            return False, None, None, []
        st.grammar.resolve(step)
        replaced, forced = None, []
        if jump and self.jump_forward:
            token_bytes = self.grammars.token_bytes if st.output_counts is None else None
            replaced, forced = st.grammar.jump_forward(self.grammars.encode, token_bytes)
            st.outputs += len(forced)
        return st.grammar.finished, st.grammar.error, replaced, forced

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
        out = self.sample_on_device(logits, slots, return_logprob, top_logprobs_num)
        return out.to_host([t.cpu() for t in out.tensors()])

    def sample_on_device(
        self,
        logits: torch.Tensor,
        slots: list[int],
        return_logprob: list[bool],
        top_logprobs_num: list[int],
    ) -> DeviceSample:
        """`sample` without reading anything back: the tokens (and logprobs) stay on the device
        (a grammar's mask is computed on the host: it waits for the slot's previous token)."""
        if self.constrained(slots):
            self.apply_constraints(logits, slots)
        states = [self.slots[s] for s in slots]
        if (
            not any(return_logprob)
            and not any(top_logprobs_num)
            and all(
                st.params.greedy and st.bias_ids is None and st.output_counts is None
                for st in states
            )
        ):  # plain greedy rows (benchmarks, most tests): one argmax, no copies
            return DeviceSample(logits.argmax(dim=-1), return_logprob, top_logprobs_num, [])
        shaped = self._apply_bias_and_penalties(logits.clone(), states)
        next_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
        greedy = [i for i, st in enumerate(states) if st.params.greedy]
        drawn = [i for i, st in enumerate(states) if not st.params.greedy]
        if not drawn:
            next_ids = shaped.argmax(dim=-1)
        elif not greedy:
            next_ids = self._draw(shaped, states)
        else:
            g, d = self._index(greedy), self._index(drawn)
            next_ids[g] = shaped[g].argmax(dim=-1)
            next_ids[d] = self._draw(shaped[d], [states[i] for i in drawn])
        self._count_outputs(next_ids, states)
        return self._logprobs(logits, next_ids, return_logprob, top_logprobs_num)

    def _index(self, rows: list[int]) -> torch.Tensor:
        return to_device(rows, torch.long, self.device)

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
        index = None if len(rows) == len(states) else self._index(rows)
        x = logits if index is None else logits[index]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - presence * (counts > 0).float()
        if index is None:
            return x
        logits[index] = x
        return logits

    def _column(self, values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, self.device).view(-1, 1)

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
        ks = to_device(
            [p.top_k if p.top_k > 0 else vocab for p in params], torch.long, probs.device
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
                st.seen.index_fill_(0, token, True)

    def _logprobs(
        self,
        logits: torch.Tensor,
        next_ids: torch.Tensor,
        return_logprob: list[bool],
        top_logprobs_num: list[int],
    ) -> DeviceSample:
        n = len(return_logprob)
        rows = [i for i in range(n) if return_logprob[i] or top_logprobs_num[i] > 0]
        out = DeviceSample(next_ids, return_logprob, top_logprobs_num, rows)
        if not rows:
            return out
        if len(rows) == n:
            lp_logits, lp_ids = logits, next_ids
        else:
            index = self._index(rows)
            lp_logits, lp_ids = logits[index], next_ids[index]
        logp = torch.log_softmax(lp_logits.float(), dim=-1)
        out.chosen = logp.gather(1, lp_ids.view(-1, 1)).view(-1)
        k = max(top_logprobs_num[i] for i in rows)
        out.top_vals, out.top_idx = (
            logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
        )
        return out
