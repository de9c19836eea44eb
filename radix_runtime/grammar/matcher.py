"""One request's grammar state in the worker, and the token masks of a batch.

A `SlotGrammar` advances with every token its slot samples. The token is accepted lazily: the
sampling step leaves it on the device and records where its host copy will be (`pending`); it
is accepted right before the next mask is filled (`resolve_all`, one wait and one read of the
step's ids for the whole batch), or when the step's result is collected. So with the overlap
schedule the mask for step N+1 is always computed after step N's token was accepted, while step
N+1's forward already runs on the device.

`BatchMasks` fills a batch's masks: xgrammar's `BatchGrammarMatcher` over `threads` threads (or,
with 0 threads, one matcher after another on the step's thread), into pinned host memory on
CUDA, so the copy to the device is queued without waiting for the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    step: int
    host_ids: torch.Tensor  # the step's sampled ids, copied (or being copied) to the host
    row: int
    event: torch.cuda.Event | None


class SlotGrammar:
    def __init__(self, compiled: xgr.CompiledGrammar, prior_outputs: np.ndarray | None = None):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.pending: _Pending | None = None
        self.error: str | None = None
        for tok in prior_outputs if prior_outputs is not None else ():
            # a retracted request: replay what it generated before (exactly the same state)
            self.accept(int(tok))

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def finished(self) -> bool:
        """Nothing more to constrain: the grammar ended, or a token broke it."""
        return self.error is not None or self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        if self.finished:
            return
        if not self.matcher.accept_token(token):
            # only possible if a token was drawn from a row with nothing allowed
            self.error = f"token {token} is not allowed by the grammar"
            logger.warning("grammar: %s", self.error)

    def set_pending(self, step: int, host_ids: torch.Tensor, row: int, event) -> None:
        self.pending = _Pending(step, host_ids, row, event)

    def resolve(self, step: int | None = None) -> None:
        """Accept the pending token (only the one sampled by `step`, when given)."""
        p = self.pending
        if p is None or (step is not None and p.step != step):
            return
        if p.event is not None:
            p.event.synchronize()
        self.pending = None
        self.accept(int(p.host_ids[p.row]))

    def jump_forward(self, encode) -> list[int]:
        """The tokens of the only continuation the grammar admits from here (fixed JSON keys,
        punctuation), accepted into the matcher; [] when there is none. The string is tokenized
        on its own (`encode`), and each token must be one the mask would allow, so the text is
        one token-by-token constrained decoding could produce. Trailing spaces are left to the
        model: ' 42' is one token, a forced ' ' then '42' two unusual ones."""
        if self.finished or self.pending is not None:
            return []
        text = self.matcher.find_jump_forward_string().rstrip(" ")
        if not text:
            return []
        accepted = []
        for token in encode(text):
            if not self.matcher.accept_token(token):
                break  # the rest is left to token-by-token decoding
            accepted.append(token)
        return accepted


def resolve_all(grammars: list[SlotGrammar]) -> None:
    """Accept every pending token of `grammars`: one event wait and one read per step's ids."""
    ids: dict[int, list[int]] = {}
    for g in grammars:
        p = g.pending
        if p is None:
            continue
        key = id(p.host_ids)
        if key not in ids:
            if p.event is not None:
                p.event.synchronize()
            ids[key] = p.host_ids.tolist()
        g.pending = None
        g.accept(ids[key][p.row])


class BatchMasks:
    """The token masks of a batch's constrained rows, filled on the host."""

    def __init__(self, vocab_size: int, threads: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.threads = threads
        self._batch = xgr.BatchGrammarMatcher(threads) if threads > 0 else None

    def fill(
        self, grammars: list[SlotGrammar | None], pinned: bool
    ) -> tuple[torch.Tensor, list[int]] | None:
        """(bitmask [B, words] int32, the rows it constrains) for a batch whose row i belongs to
        grammars[i] (None: unconstrained); None when no row needs a mask. The pending tokens are
        accepted first; the rows it does not constrain allow every token."""
        resolve_all([g for g in grammars if g is not None])
        rows = [i for i, g in enumerate(grammars) if g is not None and not g.finished]
        if not rows:
            return None
        bitmask = torch.empty((len(grammars), self.words), dtype=torch.int32, pin_memory=pinned)
        if len(rows) < len(grammars):  # the rows no grammar fills allow every token
            others = sorted(set(range(len(grammars))) - set(rows))
            bitmask.index_fill_(0, torch.tensor(others), -1)
        if self._batch is not None:
            self._batch.batch_fill_next_token_bitmask(
                [grammars[i].matcher for i in rows], bitmask, rows
            )
            return bitmask, rows
        # one by one, skipping the rows the grammar leaves unconstrained here
        return bitmask, [i for i in rows if grammars[i].matcher.fill_next_token_bitmask(bitmask, i)]


def clear_tokens(bitmask_row: torch.Tensor, token_ids: list[int]) -> None:
    """Disallow `token_ids` in one int32 bitmask row, unless nothing else would stay allowed."""
    saved = bitmask_row.clone()
    for t in token_ids:
        word, bit = divmod(t, 32)
        if word < len(bitmask_row):
            bitmask_row[word] &= ~(1 << bit) if bit < 31 else 0x7FFFFFFF
    if not bitmask_row.any():
        bitmask_row.copy_(saved)  # the grammar can only stop here: it wins over min_tokens
