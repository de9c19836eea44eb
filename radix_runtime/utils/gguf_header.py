"""The key/value header of a GGUF file, read without touching its tensors.

One reader for every consumer of GGUF metadata: the tokenizer (its vocabulary), the model
config (worker/gguf_format.py) and the preflight refusals (worker/model_config.py). It is a small
parser rather than ``gguf.GGUFReader``, which maps every tensor and wraps every array element in
numpy views: seconds for a 50k-token vocabulary.
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

import numpy as np

GGUF_MAGIC = b"GGUF"

# GGUF value types -> struct format of one scalar
_SCALAR_FORMATS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_NUMPY_DTYPES = {
    0: "u1",
    1: "i1",
    2: "u2",
    3: "i2",
    4: "u4",
    5: "i4",
    6: "f4",
    7: "?",
    10: "u8",
    11: "i8",
    12: "f8",
}
_STRING = 8
_ARRAY = 9


class _HeaderReader:
    def __init__(self, f: BinaryIO, byte_order: str):
        self.f = f
        self.bo = byte_order  # "<" or ">"

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack(self.bo + fmt, self._read(size))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        # errors="replace": a vocabulary may hold invalid UTF-8 pieces; they must not abort loading
        return self._read(n).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("I"), self.scalar("Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[etype]).newbyteorder(self.bo)
                return np.frombuffer(self._read(dtype.itemsize * count), dtype=dtype).tolist()
            return [self.value(etype) for _ in range(count)]  # nested arrays
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        raise ValueError(f"unknown GGUF value type {vtype}")

    def _read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("truncated GGUF header")
        return data


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """All key/value pairs of a GGUF file (tensors are not touched)."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        (version,) = struct.unpack("<I", f.read(4))
        # a big-endian file reads as a huge little-endian version number
        byte_order = "<" if version < 0x10000 else ">"
        r = _HeaderReader(f, byte_order)
        r.scalar("Q")  # tensor count
        kv_count = r.scalar("Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = r.string()
            metadata[key] = r.value(r.scalar("I"))
    return metadata
