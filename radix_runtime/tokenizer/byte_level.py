"""GPT-2's byte <-> printable character table, the alphabet byte-level BPE vocabularies are
spelled in (a space is ``Ġ``, a newline ``Ċ``)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:  # control bytes, space, ... move to unused code points from 256 on
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def spell(text: str) -> str:
    """``text`` in the byte alphabet."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))
