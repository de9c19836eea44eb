"""Text <-> token ids: tokenizers from HF folders, sentencepiece models and GGUF files, chat
templates, UTF-8 safe incremental detokenization and stop strings."""

from .chat_template import CHATML_TEMPLATE, normalize_messages
from .detokenizer import IncrementalDetokenizer
from .stop import StopMatcher
from .tokenizer import Tokenizer, byte_tokenizer, load_tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "IncrementalDetokenizer",
    "StopMatcher",
    "Tokenizer",
    "byte_tokenizer",
    "load_tokenizer",
    "normalize_messages",
]
