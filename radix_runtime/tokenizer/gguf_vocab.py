"""The tokenizer stored in a GGUF file's metadata, rebuilt as a Hugging Face ``tokenizers`` one.

A GGUF has no tokenizer.json: it stores llama.cpp's description of one under ``tokenizer.ggml.*``:

- ``model`` ``gpt2``: byte-level BPE from ``tokens`` + ``merges``; how text is cut into words
  before merging is named by ``pre`` (``smollm``, ``llama-bpe``, ``qwen2``, ...).
- ``model`` ``llama``: sentencepiece-style BPE from ``tokens`` + ``scores`` + ``token_type``
  (built by :mod:`.spm`).

Token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.

Only the key/value header is read (`radix_runtime.utils.gguf_header`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from radix_runtime.utils.gguf_header import read_gguf_metadata

from . import byte_level, spm

logger = logging.getLogger(__name__)

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# ---------------------------------------------------------------------------------------------
# pre-tokenizer regexes (llama.cpp names them by tokenizer.ggml.pre)

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    splits: tuple[str, ...]  # regexes applied in order, each isolating its matches
    ignore_merges: bool = False  # a word that is itself a token is not merged (tiktoken style)
    nfc: bool = False  # the reference tokenizer.json normalizes to NFC first


PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    "gpt2": PreTokenizerSpec((GPT2_SPLIT,)),
    "default": PreTokenizerSpec((GPT2_SPLIT,)),
    # SmolLM: every digit is its own word, then the GPT-2 regex
    "smollm": PreTokenizerSpec((r"\p{N}", GPT2_SPLIT)),
    "llama-bpe": PreTokenizerSpec((LLAMA3_SPLIT,), ignore_merges=True),
    "llama3": PreTokenizerSpec((LLAMA3_SPLIT,), ignore_merges=True),
    "llama-v3": PreTokenizerSpec((LLAMA3_SPLIT,), ignore_merges=True),
    "qwen2": PreTokenizerSpec((QWEN2_SPLIT,), nfc=True),
    "deepseek-r1-qwen": PreTokenizerSpec((QWEN2_SPLIT,), nfc=True),
}


def pre_tokenizer_spec(name: str | None) -> PreTokenizerSpec:
    spec = PRE_TOKENIZERS.get(name or "default")
    if spec is None:
        logger.warning("unknown GGUF pre-tokenizer %r: falling back to the GPT-2 regex", name)
        spec = PRE_TOKENIZERS["gpt2"]
    return spec


# ---------------------------------------------------------------------------------------------
# building the tokenizer


@dataclass
class GgufTokenizerInfo:
    """What the Tokenizer wrapper needs besides the ``tokenizers`` object."""

    tokenizer: HFTokenizer
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    extra_eos_ids: list[int] = field(default_factory=list)  # end-of-turn / end-of-message ids


def load_gguf_tokenizer(path: str) -> GgufTokenizerInfo:
    meta = read_gguf_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"{path} holds no tokenizer vocabulary (tokenizer.ggml.tokens)")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if model == "gpt2":
        tokens = _respell_byte_level(tokens, token_types)
        tok = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], meta)
        add_bos_default = False
    elif model == "llama":
        add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        tok = spm.build_spm_tokenizer(
            spm.SpmVocab(
                pieces=tokens,
                scores=meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens),
                types=token_types,
                algorithm="bpe",
                byte_fallback=True,
                unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
                add_dummy_prefix=add_space_prefix,
            )
        )
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says not to
        add_bos_default = True
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)")

    _add_special_tokens(tok, tokens, token_types)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    tok.post_processor = bos_eos_processor(
        tokens[bos] if add_bos else None, bos, tokens[eos] if add_eos else None, eos
    )
    return GgufTokenizerInfo(
        tokenizer=tok,
        vocab_size=len(tokens),
        bos_token_id=bos,
        eos_token_id=eos,
        add_bos_token=add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
        extra_eos_ids=[
            meta[k]
            for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if k in meta
        ],
    )


def _byte_level_bpe(tokens: list[str], merges: list[str], meta: dict[str, Any]) -> HFTokenizer:
    spec = pre_tokenizer_spec(meta.get("tokenizer.ggml.pre"))
    vocab = {t: i for i, t in enumerate(tokens)}
    # a merge is "left right"; byte-level pieces never hold a real space (it is spelled "Ġ")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=spec.ignore_merges))
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in spec.splits]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _respell_byte_level(tokens: list[str], token_types: list[int]) -> list[str]:
    """A normal token outside the byte alphabet (written raw by some converters) is re-spelled,
    or BPE could never produce it; control and user-defined tokens keep their raw text, which is
    what gets matched in the input."""
    alphabet = set(byte_level.bytes_to_unicode().values())
    return [
        byte_level.spell(t) if ty == TOKEN_TYPE_NORMAL and not set(t) <= alphabet else t
        for t, ty in zip(tokens, token_types)
    ]


def _add_special_tokens(tok: HFTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special (matched whole in text, skipped when decoding); user-defined
    ones become plain added tokens (matched whole, kept when decoding) -- as llama.cpp does.
    Their ids stay the file's: a token already in the vocabulary is not appended again."""
    control = [t for t, ty in zip(tokens, token_types) if ty == TOKEN_TYPE_CONTROL and t]
    user = [t for t, ty in zip(tokens, token_types) if ty == TOKEN_TYPE_USER_DEFINED and t]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def bos_eos_processor(
    bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None
) -> processors.PostProcessor:
    """A post-processor that adds BOS and/or EOS around one sequence (or nothing)."""
    single = ([bos] if bos else []) + ["$A"] + ([eos] if eos else [])
    pair = single + ["$B:1"] + ([f"{eos}:1"] if eos else [])
    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(dict.fromkeys(special))
    )
