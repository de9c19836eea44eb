"""One request's grammar state in the worker, and the token masks of a batch.

A `SlotGrammar` advances with every token its slot samples. The token is accepted lazily: the
sampling step leaves it on the device and records where its host copy will be (`pending`); it
is accepted right before the next mask is filled (`resolve`), or when the step's result is
collected. So with the overlap schedule the mask for step N+1 is always computed after step N's
token was accepted, while step N+1's forward already runs on the device.
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

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed tokens into bitmask[row]; False when the row needs no mask."""
        self.resolve()
        if self.finished:
            return False  # the step's result for this slot is discarded (it finished)
        return self.matcher.fill_next_token_bitmask(bitmask, row)


def clear_tokens(bitmask_row: torch.Tensor, token_ids: list[int]) -> None:
    """Disallow `token_ids` in one int32 bitmask row, unless nothing else would stay allowed."""
    saved = bitmask_row.clone()
    for t in token_ids:
        word, bit = divmod(t, 32)
        if word < len(bitmask_row):
            bitmask_row[word] &= ~(1 << bit) if bit < 31 else 0x7FFFFFFF
    if not bitmask_row.any():
        bitmask_row.copy_(saved)  # the grammar can only stop here: it wins over min_tokens
