"""Grammar compilation with xgrammar, off the worker's step loop, cached by (kind, text).

`GrammarCache.submit(kind, text)` starts a compile on a thread pool (xgrammar releases the GIL
while it compiles, so forward steps keep running); `take_finished()` hands the loop the compiles
that completed, to report to the scheduler; `get(kind, text)` returns a compiled grammar (it
waits for, or as a last resort runs, the compile: only when the cache evicted a grammar the
scheduler still believed compiled).

The xgrammar TokenizerInfo is built from OUR tokenizer (radix_runtime.tokenizer): every token's
exact bytes (`Tokenizer.token_bytes`, which handles byte-level BPE, sentencepiece byte fallback
and added tokens alike) as a RAW vocabulary, special tokens as empty strings (never allowed inside
a grammar), the model's EOS ids as the stop tokens; the logits columns past the tokenizer's
ids (a model's padded vocabulary) are masked by the sampler, not by xgrammar.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from radix_runtime.grammar import WORKER_CACHED_GRAMMARS

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "json", "regex", "ebnf")


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer` for a model whose logits have `vocab_size` columns: the
    tokenizer's ids only (at most `vocab_size`). The logits columns past them have no token;
    the sampler never allows them in a constrained row (`Sampler.apply_constraints`). Padding
    them here as empty (special) tokens would cost every accepted token a scan of xgrammar's
    special-token list: ~50 us per token for a 259-token vocabulary under 128,256 columns.

    The stop tokens: the model's EOS ids the tokenizer has, else (dummy weights with a
    stand-in tokenizer) the tokenizer's own EOS ids."""
    n = min(tokenizer.vocab_size, vocab_size)
    vocab = [b"" if tokenizer.is_special(i) else tokenizer.token_bytes(i) for i in range(n)]
    stops = [t for t in stop_token_ids if 0 <= t < n]
    if not stops:
        stops = [t for t in tokenizer.eos_token_ids if 0 <= t < n]
        logger.warning(
            "grammar: the model's EOS ids %s are not in the tokenizer's %d ids: a grammar stops "
            "on the tokenizer's %s",
            list(stop_token_ids), n, stops,
        )  # fmt: skip
    return xgr.TokenizerInfo(
        vocab, vocab_type=xgr.VocabType.RAW, vocab_size=n, stop_token_ids=stops
    )


def compile_grammar(compiler: xgr.GrammarCompiler, kind: str, text: str) -> xgr.CompiledGrammar:
    """One compile. JSON is compact (", " and ": " separators, no free whitespace): a small model
    cannot wander into runs of blank lines, and fixed keys become jump-forward strings."""
    if kind == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=False)
    if kind == "json":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def error_message(kind: str, exc: Exception) -> str:
    """xgrammar's message without its C++ file/line prefix."""
    text = str(exc).strip()
    if "]" in text and text.startswith("["):  # "[14:34:01] /project/cpp/x.cc:94: Regex parsing..."
        text = text.split("]", 1)[1].strip()
        if ": " in text and text.split(": ", 1)[0].endswith(tuple("0123456789")):
            text = text.split(": ", 1)[1]
    name = {"json_schema": "JSON schema", "json": "JSON", "regex": "regex", "ebnf": "EBNF grammar"}
    return f"invalid {name.get(kind, kind)}: {text}"


@dataclass
class CompileDone:
    kind: str
    text: str
    error: str | None
    compile_s: float
    cache_hit: bool


class GrammarCache:
    """Compiled grammars keyed by (kind, text), compiled on `threads` threads."""

    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: list[int],
        threads: int = 2,
        capacity: int = WORKER_CACHED_GRAMMARS,
    ) -> None:
        # deferred to the first compile (on a compile thread): loading the tokenizer and reading
        # its vocabulary takes a second or so
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.tokenizer = None
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._capacity = capacity
        self._done: list[CompileDone] = []
        self._done_lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def warm(self) -> None:
        """Read the vocabulary now, on a compile thread, so the first grammar does not wait."""
        self._pool.submit(self._get_compiler)

    @property
    def info(self) -> xgr.TokenizerInfo:
        self._get_compiler()
        return self._info

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self.tokenizer = self._load_tokenizer()
                self._info = tokenizer_info(self.tokenizer, self._vocab_size, self._stop_token_ids)
                # xgrammar's own cache stays off: ours is keyed the same way and bounded
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        t0 = time.perf_counter()
        try:
            compiled = compile_grammar(self._get_compiler(), kind, text)
        except Exception as exc:
            self._report(CompileDone(kind, text, error_message(kind, exc), 0.0, False))
            raise
        self._report(CompileDone(kind, text, None, time.perf_counter() - t0, False))
        return compiled

    def _report(self, done: CompileDone) -> None:
        with self._done_lock:
            self._done.append(done)

    def submit(self, kind: str, text: str) -> None:
        """Start compiling (or, cached, report at once); the outcome comes from take_finished."""
        key = (kind, text)
        fut = self._cache.get(key)
        if fut is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            if fut.done():
                error = fut.exception()
                msg = error_message(kind, error) if error is not None else None
                self._report(CompileDone(kind, text, msg, 0.0, True))
            # else it is compiling: its own report, when done, answers this request too
            return
        self.misses += 1
        fut = self._pool.submit(self._compile, kind, text)
        self._cache[key] = fut
        while len(self._cache) > self._capacity:
            self._cache.popitem(last=False)

    def pending(self) -> int:
        return sum(1 for f in self._cache.values() if not f.done())

    def take_finished(self) -> list[CompileDone]:
        with self._done_lock:
            done, self._done = self._done, []
        return done

    def get(self, kind: str, text: str) -> xgr.CompiledGrammar:
        key = (kind, text)
        fut = self._cache.get(key)
        if fut is None:
            logger.warning("grammar %s was not compiled ahead (evicted?): compiling now", kind)
            compiled = compile_grammar(self._get_compiler(), kind, text)
            fut = Future()
            fut.set_result(compiled)
            self._cache[key] = fut
            return compiled
        self._cache.move_to_end(key)
        return fut.result()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens), for jump-forward."""
        self._get_compiler()
        return self.tokenizer.encode(text, add_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        """A token's exact bytes (b"" for a padding id), for jump-forward's boundary."""
        self._get_compiler()
        if token >= self.tokenizer.vocab_size:
            return b""
        return self.tokenizer.token_bytes(token)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
