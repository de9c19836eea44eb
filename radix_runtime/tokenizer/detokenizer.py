"""UTF-8 safe incremental detokenization.

The prefix/read offset technique (as in vLLM, SGLang and TGI): each step decodes a short window
of the latest tokens twice -- once up to what was already emitted (``prefix_text``), once with the
new tokens (``new_text``) -- and emits the difference. Decoding a window rather than single tokens
keeps what depends on neighbours right (sentencepiece's dropped leading space, byte-fallback
and byte-level pieces of one character). When the window ends in U+FFFD a character is still
incomplete (an emoji spread over several byte tokens), so nothing is emitted until it completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# prompt tokens kept as left context, so the first output token decodes as it would mid-text
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tok: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self.tok = tok
        self.skip_special_tokens = skip_special_tokens
        # only the prompt's last tokens are kept: they are all a window ever looks back to
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids is not None else []
        self.ids: list[int] = [int(i) for i in context]
        self.read_offset = len(self.ids)  # tokens before this are already in ``text``
        self.prefix_offset = 0  # the decode window starts here
        self.text = ""  # everything emitted so far

    def add(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; returns the newly completed text (maybe "")."""
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.ids))
        # NOTE: a longer window must not end in U+FFFD: that is a character still incomplete
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is held back (an incomplete character is emitted
        as U+FFFD, as a full decode would show it)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.ids))
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tok.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)
