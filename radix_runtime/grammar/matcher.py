"""One request's grammar state in the worker, and the token masks of a batch.

A `SlotGrammar` advances with every token its slot samples. The token is accepted lazily: the
sampling step leaves it on the device and records where its host copy will be (`pending`); it
is accepted right before the next mask is filled (`resolve_all`, one wait and one read of the
step's ids for the whole batch), or when the step's result is collected. So with the overlap
schedule the mask for step N+1 is always computed after step N's token was accepted, while step
N+1's forward already runs on the device.

`BatchMasks` fills a batch's masks: xgrammar's `BatchGrammarMatcher` over `threads` threads (or,
with 0 threads, one matcher after another on the step's thread), into pinned host memory on
CUDA, so the copy to the device is queued without waiting for the device. The masks cover the
tokenizer's ids; the logits columns past them (a padded vocabulary) are the sampler's to mask.
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
        self.last_token: int | None = None  # the token accepted last
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
        else:
            self.last_token = token

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

    def jump_forward(self, encode, token_bytes=None) -> tuple[int | None, list[int]]:
        """The tokens of the only continuation the grammar admits from here (fixed JSON keys,
        punctuation), accepted into the matcher: (a replacement of the token sampled last or
        None, the forced tokens); (None, []) when there is none. Each token must be one the mask
        would allow, so the text is one token-by-token constrained decoding could produce.
        Trailing spaces are left to the model: ' 42' is one token, a forced ' ' then '42' two
        unusual ones.

        With `token_bytes` (id -> bytes) the boundary is re-tokenized: the sampled token's text
        and the forced string are encoded together (`{` then `"name": ` becomes `{"`, `name`,
        `":`), and when the first token differs the sampled one is replaced (the matcher rolls it
        back; the model has not computed it yet). Without it, or where the joint encoding does
        not spell the same bytes or the grammar refuses its first token, the forced string is
        encoded on its own after the sampled token."""
        if self.finished or self.pending is not None:
            return None, []
        text = self.matcher.find_jump_forward_string().rstrip(" ")
        if not text:
            return None, []
        if token_bytes is not None and self.last_token is not None:
            joint = self._retokenized(encode, token_bytes, text)
            if joint is not None:
                return joint
        return None, self._accept_prefix(encode(text))

    def _retokenized(self, encode, token_bytes, text: str) -> tuple[int | None, list[int]] | None:
        last = self.last_token
        try:
            prev = token_bytes(last).decode("utf-8")
        except UnicodeDecodeError:  # the sampled token ends inside a character
            return None
        ids = encode(prev + text)
        if not ids or b"".join(token_bytes(t) for t in ids) != (prev + text).encode("utf-8"):
            return None
        if ids[0] == last:  # the same boundary: the rest is the forced string's tokens
            return None, self._accept_prefix(ids[1:])
        self.matcher.rollback(1)
        accepted = self._accept_prefix(ids)
        if not accepted:  # the joint first token is not allowed here: keep the sampled one
            self.matcher.accept_token(last)
            self.last_token = last
            return None
        return accepted[0], accepted[1:]

    def _accept_prefix(self, tokens: list[int]) -> list[int]:
        """Accept `tokens` up to the first one the grammar refuses; the accepted ones."""
        accepted = []
        for token in tokens:
            if not self.matcher.accept_token(token):
                break  # the rest is left to token-by-token decoding
            self.last_token = token
            accepted.append(token)
        return accepted


def resolve_all(grammars: list[SlotGrammar], step: int | None = None) -> None:
    """Accept every pending token of `grammars` (only those sampled by `step`, when given): one
    event wait and one read per step's ids."""
    ids: dict[int, list[int]] = {}
    for g in grammars:
        p = g.pending
        if p is None or (step is not None and p.step != step):
            continue
        key = id(p.host_ids)
        if key not in ids:
            if p.event is not None:
                p.event.synchronize()
            ids[key] = p.host_ids.tolist()
        g.pending = None
        g.accept(ids[key][p.row])


class BatchMasks:
    """The token masks of a batch's constrained rows, filled on the host, over the grammar's
    `vocab_size` ids (the tokenizer's: `GrammarCache.info`)."""

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
        matchers = [grammars[i].matcher for i in rows]
        if self._batch is not None:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        else:  # a row the grammar leaves unconstrained here is filled with every token allowed
            for i, matcher in zip(rows, matchers):
                matcher.fill_next_token_bitmask(bitmask, i)
        return bitmask, rows


def clear_tokens(bitmask_row: torch.Tensor, token_ids: list[int]) -> None:
    """Disallow `token_ids` in one int32 bitmask row, unless nothing else would stay allowed."""
    saved = bitmask_row.clone()
    for t in token_ids:
        word, bit = divmod(t, 32)
        if word < len(bitmask_row):
            bitmask_row[word] &= ~(1 << bit) if bit < 31 else 0x7FFFFFFF
    if not bitmask_row.any():
        bitmask_row.copy_(saved)  # the grammar can only stop here: it wins over min_tokens
