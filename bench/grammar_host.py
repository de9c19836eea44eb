"""The host's share of a constrained decode step: accepting each row's sampled token and filling
the batch's grammar masks (`Sampler.grammar_masks`), per step, in-process (no model, no server).

    python bench/grammar_host.py [--batch 64] [--vocab 128256] [--steps 60]
        [--threads 0,4,8,auto] [--tokenizer default] [--out docs/results/cpu_grammar_host.json]

Every row is constrained by one of three grammars and decodes a fixed valid text from its own
offset (so the rows are in different grammar states): bench/structured.py's long integer array,
an object schema with strings, numbers, enums and a nested array, and any JSON. Per --threads
value (0: the matchers one after another on the step's thread; N: xgrammar's
BatchGrammarMatcher on N threads; auto: the server's default on a CUDA host with this machine's
cores, config.auto_grammar_fill_threads), the median host ms per step of accept + fill at each
grammar (and of the accept alone), and the ratio to `per_row` measured in the same run,
interleaved: the worker's previous path (the logits columns past the tokenizer's ids padded into
xgrammar's vocabulary as special tokens, each row's token read from the step's ids and accepted
on its own, a fresh bitmask, the matchers filled one after another).

This is the work the worker does between step N's token reaching the host and step N+1's
mask being queued; on a GPU it overlaps step N+1's forward (docs/structured_output.md), so it
costs throughput only where it is longer than the forward. The mask's device copy and the
apply kernel are device work and not timed here (on the CPU device the apply kernel is a
separate cost, see the results file's `cpu_apply_ms`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import provenance, write_json
from bench.structured import LONG_ARRAY

OBJECT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "tier": {"enum": ["gold", "silver", "bronze"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "score", "tier", "tags"],
}


def texts(steps: int) -> dict[str, tuple[tuple[str, str], str]]:
    """grammar name -> ((kind, text), a valid output long enough for every offset + steps)."""
    array = "[" + ", ".join(str(i * 7919 % 100000) for i in range(40 * steps))
    obj = json.dumps(
        {
            "name": "Ada Lovelace of the Analytical Engine",
            "age": 36,
            "score": 98.25,
            "tier": "gold",
            "tags": [f"tag number {i} of the list" for i in range(4 * steps)],
        },
        separators=(", ", ": "),
    )
    anyjson = json.dumps(
        [{"id": i, "text": f"item {i}", "ok": i % 2 == 0} for i in range(steps * 8)]
    )
    return {
        "long_array": (("json_schema", json.dumps(LONG_ARRAY)), array),
        "object": (("json_schema", json.dumps(OBJECT)), obj),
        "any_json": (("json", ""), anyjson),
    }


def padded_cache(tokenizer, vocab: int):
    """A GrammarCache whose xgrammar vocabulary is padded to `vocab` ids with empty (special)
    tokens, as the worker's was before its masks covered the tokenizer's ids only."""
    import xgrammar as xgr

    from radix_runtime.grammar.compiler import GrammarCache

    class Padded(GrammarCache):
        def _get_compiler(self):
            with self._compiler_lock:
                if self._compiler is None:
                    self.tokenizer = tokenizer
                    n = min(tokenizer.vocab_size, vocab)
                    tokens = [
                        b"" if tokenizer.is_special(i) else tokenizer.token_bytes(i)
                        for i in range(n)
                    ]
                    self._info = xgr.TokenizerInfo(
                        tokens + [b""] * (vocab - n),
                        vocab_type=xgr.VocabType.RAW,
                        vocab_size=vocab,
                        stop_token_ids=list(tokenizer.eos_token_ids),
                    )
                    self._compiler = xgr.GrammarCompiler(
                        self._info, max_threads=1, cache_enabled=False
                    )
                return self._compiler

    return Padded(lambda: tokenizer, vocab, list(tokenizer.eos_token_ids))


def per_row_masks(sampler, slots: list[int]):
    """The reference: each row's pending token read and accepted on its own, a fresh bitmask,
    the matchers filled one after another (the worker's path before `BatchMasks`)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(slots), sampler.vocab_size)
    rows = []
    for i, slot in enumerate(slots):
        g = sampler.slots[slot].grammar
        g.resolve()
        if not g.finished and g.matcher.fill_next_token_bitmask(bitmask, i):
            rows.append(i)
    return bitmask, rows


def measure(sampler, params, ids: list[int], batch: int, steps: int, reference=False):
    """(seconds of grammar_masks (`reference`: per_row_masks) per step, seconds of its accepting
    the step's tokens), for `batch` rows decoding `ids` from offsets i*3."""
    slots = list(range(batch))
    for slot in slots:
        sampler.reset_slot(slot, params)
        for tok in ids[: slot * 3]:
            sampler.slots[slot].grammar.accept(tok)
    times, accepts = [], []
    for step in range(steps):
        host_ids = torch.tensor([ids[slot * 3 + step] for slot in slots])
        sampler.note_sampled(slots, step, host_ids, None)
        t0 = time.perf_counter()
        if reference:
            masks = per_row_masks(sampler, slots)
        else:  # the worker's order: collect accepts the step's tokens, then the masks
            sampler.resolve_step(slots, step)
            accepts.append(time.perf_counter() - t0)
            masks = sampler.grammar_masks(slots)
        times.append(time.perf_counter() - t0)
        assert masks is not None
        for slot in slots:
            assert sampler.slots[slot].grammar.error is None, sampler.slots[slot].grammar.error
    for slot in slots:
        sampler.release(slot)
    return times, accepts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128256, help="logits width (Llama 3: 128256)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads", default="0,4,8,auto", help="fill threads to time (auto: the CUDA default)"
    )
    ap.add_argument(
        "--tokenizer",
        default="default",
        help="the vocabulary (load_tokenizer: 'default', a HF folder such as one written by "
        "bench/export_tokenizer.py, a .gguf); without the default model: 259 byte tokens",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import xgrammar as xgr

    from radix_runtime.config import auto_grammar_fill_threads
    from radix_runtime.grammar.compiler import GrammarCache
    from radix_runtime.messages import ANY_JSON, SamplingParams
    from radix_runtime.model_source import ModelNotFound
    from radix_runtime.tokenizer import byte_tokenizer, load_tokenizer
    from radix_runtime.worker.sampler import Sampler

    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except ModelNotFound:
        tokenizer = byte_tokenizer()
    cache = GrammarCache(lambda: tokenizer, args.vocab, list(tokenizer.eos_token_ids))
    cores = len(os.sched_getaffinity(0))
    auto = auto_grammar_fill_threads("cuda", cores)
    labels = args.threads.split(",")  # "auto" is timed under its own name
    threads = {t: auto if t == "auto" else int(t) for t in labels}
    print(f"{cores} cores: the CUDA default (auto) is {auto} fill threads")
    reference_cache = padded_cache(tokenizer, args.vocab)
    rows = []
    for name, ((kind, text), output) in texts(args.steps).items():
        for c in (cache, reference_cache):
            c.submit(kind, text)
            c.get(kind, text)
        params = SamplingParams(
            temperature=0.0,
            max_new_tokens=1 << 20,
            json_schema=text if kind == "json_schema" else ANY_JSON,
        )
        ids = tokenizer.encode(output, add_special_tokens=False)
        assert len(ids) >= args.batch * 3 + args.steps, (name, len(ids))
        row = {"grammar": name, "ms_per_step": {}, "accept_ms_per_step": {}}
        samplers = {
            "per_row": Sampler(args.vocab, torch.device("cpu"), 0, [], reference_cache),
            **{
                label: Sampler(args.vocab, torch.device("cpu"), 0, [], cache, fill_threads=n)
                for label, n in threads.items()
            },
        }
        samples: dict[str, list[float]] = {key: [] for key in samplers}
        accepts: dict[str, list[float]] = {key: [] for key in samplers}
        variants = list(samples)
        for r in range(args.repeats):  # interleaved, the order rotated: a busy machine slows
            for key in variants[r % len(variants) :] + variants[: r % len(variants)]:  # all alike
                times, accepted = measure(
                    samplers[key], params, ids, args.batch, args.steps, key == "per_row"
                )
                samples[key] += times[5:]
                accepts[key] += accepted[5:]
        for key, values in samples.items():
            row["ms_per_step"][key] = statistics.median(values) * 1e3
            if accepts[key]:
                row["accept_ms_per_step"][key] = statistics.median(accepts[key]) * 1e3
        base = row["ms_per_step"]["per_row"]
        row["ratio_to_per_row"] = {k: v / base for k, v in row["ms_per_step"].items()}
        rows.append(row)
        print(
            f"{name:>11}: "
            + "  ".join(
                f"{k if k == 'per_row' else k + ' threads'} {v:.3f} ms"
                + (f" (accept {row['accept_ms_per_step'][k]:.3f})" if k != "per_row" else "")
                for k, v in row["ms_per_step"].items()
            )
        )
    logits = torch.randn(args.batch, args.vocab)
    bitmask = xgr.allocate_token_bitmask(args.batch, args.vocab)
    t0 = time.perf_counter()
    for _ in range(5):
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=args.vocab)
    apply_ms = (time.perf_counter() - t0) / 5 * 1e3
    print(f"CPU apply kernel (device work on a GPU): {apply_ms:.2f} ms per step")
    result = {
        "provenance": provenance(
            "per_row (xgrammar's vocabulary padded to --vocab with special tokens, each row's "
            "token read and accepted on its own, a fresh bitmask, the matchers filled one "
            "after another: the worker's path before BatchMasks), in the same run, interleaved"
        ),
        "config": {
            "batch": args.batch,
            "vocab": args.vocab,
            "steps": args.steps,
            "repeats": args.repeats,
            "threads": threads,  # label -> fill threads
            "cores": cores,
            # --tokenizer, or (a machine without the default model) 259 byte tokens; the logits
            # columns past it up to --vocab are never allowed
            "tokenizer": args.tokenizer,
            "tokenizer_vocab": tokenizer.vocab_size,
        },
        "host_ms_per_step": rows,
        "cpu_apply_ms": apply_ms,
    }
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
