"""Stop strings over streamed text.

Text that could be the beginning of a stop string is held back until it is known either way, so a
client never sees part of a stop string. Stop strings are matched on the detokenized text (they
may span several tokens); stop *token ids* are the scheduler's business.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    def __init__(self, stop: Iterable[str] | None):
        self.stops = [s for s in dict.fromkeys(stop or ()) if s]
        # the longest text that may be held back: all but the last character of a stop string
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was reached). After a stop, the
        rest of the stream is dropped."""
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        buf = self._held + delta
        hit = self._first_completed(buf)
        if hit is not None:
            pos, stop = hit
            self.stopped, self.matched, self._held = True, stop, ""
            return buf[:pos], True
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, at the end of a stream that did not stop on a string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_completed(self, buf: str) -> tuple[int, str] | None:
        """The stop string that completes first (the earliest end; at one end the longer, which
        starts earlier): where generation stops when text arrives a character at a time, so the
        result does not depend on how the text was cut into deltas. Returns (start, string)."""
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i < 0:
                continue
            end, best_end = i + len(s), best and best[0] + len(best[1])
            if best is None or end < best_end or (end == best_end and i < best[0]):
                best = (i, s)
        return best

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest end of ``buf`` that is a proper beginning of some stop string."""
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[len(buf) - n :]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
