"""Sentencepiece vocabularies (``tokenizer.model`` files and GGUF ``llama`` vocabularies) rebuilt
as Hugging Face ``tokenizers`` objects, so every source shares one fast encode/decode path.

``tokenizer.model`` is a protobuf ``ModelProto``; the few fields needed are read with a small
wire-format parser below, so the ``protobuf`` package is not required.

Spaces follow sentencepiece (and llama.cpp): a space is the piece character ``▁`` and, with
``add_dummy_prefix``, every run of text (also the text after a special token) starts with one;
decoding drops that one leading space again.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

SPACE = "\u2581"  # ▁

# sentencepiece piece types (the same numbers as llama.cpp's token types)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class SpmVocab:
    pieces: list[str]
    scores: list[float]
    types: list[int]
    algorithm: str = "bpe"  # "bpe" | "unigram"
    byte_fallback: bool = True
    unk_id: int | None = 0
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = False
    precompiled_charsmap: bytes = b""
    bos_id: int | None = None
    eos_id: int | None = None


# ---------------------------------------------------------------------------------------------
# building


def build_spm_tokenizer(vocab: SpmVocab) -> HFTokenizer:
    if vocab.algorithm == "unigram":
        model = models.Unigram(
            [(p, s) for p, s in zip(vocab.pieces, vocab.scores)],
            unk_id=vocab.unk_id,
            byte_fallback=vocab.byte_fallback,
        )
    else:
        model = models.BPE(
            vocab={p: i for i, p in enumerate(vocab.pieces)},
            merges=derive_merges(vocab),
            unk_token=vocab.pieces[vocab.unk_id] if vocab.unk_id is not None else None,
            byte_fallback=vocab.byte_fallback,
            fuse_unk=True,
        )
    tok = HFTokenizer(model)
    tok.normalizer = _normalizer(vocab)
    tok.pre_tokenizer = None  # sentencepiece merges over the whole (space-escaped) text
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    control = [p for p, t in zip(vocab.pieces, vocab.types) if t == CONTROL]
    user = [p for p, t in zip(vocab.pieces, vocab.types) if t == USER_DEFINED]
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in control])
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in user])
    return tok


def derive_merges(vocab: SpmVocab) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece BPE vocabulary.

    Sentencepiece merges the adjacent pair whose concatenation has the highest score; a BPE merge
    list ranked by the score of the merged piece does the same.
    """
    ids = {p: i for i, p in enumerate(vocab.pieces) if vocab.types[i] in (NORMAL, USER_DEFINED)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, pid in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-vocab.scores[pid], pid, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _normalizer(vocab: SpmVocab) -> normalizers.Normalizer:
    steps: list[normalizers.Normalizer] = []
    if vocab.precompiled_charsmap:
        steps.append(normalizers.Precompiled(vocab.precompiled_charsmap))
    if vocab.remove_extra_whitespaces:
        # sentencepiece trims and squeezes only the space character, not tabs or newlines
        steps += [
            normalizers.Replace(Regex(r"\A +| +\z"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if vocab.add_dummy_prefix:
        steps.append(normalizers.Prepend(SPACE))
    steps.append(normalizers.Replace(" ", SPACE))
    return normalizers.Sequence(steps)


# ---------------------------------------------------------------------------------------------
# tokenizer.model (protobuf ModelProto) without the protobuf package

# field numbers from sentencepiece_model.proto
_MODEL_PIECES, _MODEL_TRAINER, _MODEL_NORMALIZER = 1, 2, 3
_PIECE_TEXT, _PIECE_SCORE, _PIECE_TYPE = 1, 2, 3
_TRAINER_MODEL_TYPE, _TRAINER_BYTE_FALLBACK = 3, 35
_TRAINER_UNK_ID, _TRAINER_BOS_ID, _TRAINER_EOS_ID = 40, 41, 42
_NORM_CHARSMAP, _NORM_DUMMY_PREFIX, _NORM_REMOVE_WS = 2, 3, 4
_MODEL_TYPE_BPE = 2


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, Any]]:
    """(field number, value) pairs of one message: ints for varints, bytes for
    length-delimited fields, raw 4/8 bytes for fixed-width ones."""
    out: list[tuple[int, Any]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((num, value))
    return out


def _int32(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v  # negative int32 is sign-extended to 64 bits


def read_spm_model(path: str) -> SpmVocab:
    with open(path, "rb") as f:
        data = f.read()
    pieces: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    trainer: dict[int, Any] = {}
    normalizer: dict[int, Any] = {}
    for num, value in _fields(data):
        if num == _MODEL_PIECES:
            piece = dict(_fields(value))
            pieces.append(piece.get(_PIECE_TEXT, b"").decode("utf-8"))
            raw_score = piece.get(_PIECE_SCORE)
            scores.append(struct.unpack("<f", raw_score)[0] if raw_score else 0.0)
            types.append(piece.get(_PIECE_TYPE, NORMAL))
        elif num == _MODEL_TRAINER:
            trainer = dict(_fields(value))
        elif num == _MODEL_NORMALIZER:
            normalizer = dict(_fields(value))
    if not pieces:
        raise ValueError(f"{path} holds no sentencepiece pieces")

    def special_id(field: int, default: int) -> int | None:
        v = _int32(trainer.get(field, default))
        return v if 0 <= v < len(pieces) else None

    return SpmVocab(
        pieces=pieces,
        scores=scores,
        types=types,
        algorithm="bpe" if trainer.get(_TRAINER_MODEL_TYPE) == _MODEL_TYPE_BPE else "unigram",
        byte_fallback=bool(trainer.get(_TRAINER_BYTE_FALLBACK, 0)),
        unk_id=special_id(_TRAINER_UNK_ID, 0),
        add_dummy_prefix=bool(normalizer.get(_NORM_DUMMY_PREFIX, 1)),
        remove_extra_whitespaces=bool(normalizer.get(_NORM_REMOVE_WS, 1)),
        precompiled_charsmap=bytes(normalizer.get(_NORM_CHARSMAP, b"")),
        bos_id=special_id(_TRAINER_BOS_ID, 1),
        eos_id=special_id(_TRAINER_EOS_ID, 2),
    )
