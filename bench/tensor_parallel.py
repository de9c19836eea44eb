"""Tensor parallelism's speed-up: decode tok/s of the whole server (Engine: scheduler + worker
ranks, CUDA graphs, the overlap schedule) at `--tp N` against `--tp 1`, measured in one run on the
same machine (the reference is the --tp 1 server of the same run).

For each batch size B the same B random prompts (no radix cache, so both calls prefill alike) are
generated once with 1 new token and once with 1 + STEPS: decode tok/s = B * STEPS / (time of the
long call - time of the short one), which leaves out prefill and the first token.

    python bench/tensor_parallel.py --model-config llama-3.1-8b --tp 2 --batch-sizes 1,64 \\
        --out docs/results/h200x2_tensor_parallel.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import provenance, safe_token_range
from radix_runtime import Engine


def engine_flags(a: argparse.Namespace, tp: int) -> dict:
    return dict(
        model=a.model_config,
        load_format="dummy",
        model_config=a.model_config,
        tp=tp,
        context_length=a.prompt_len + a.steps + 64,
        max_running_requests=max(a.batch_sizes),
        cuda_graph_max_bs=max(a.batch_sizes),
        disable_radix_cache=True,
        mem_fraction_static=a.mem_fraction_static,
        log_level="warning",
    )


def decode_tok_s(engine: Engine, prompts: list[list[int]], steps: int, repeats: int) -> float:
    def timed(new_tokens: int) -> float:
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        return time.perf_counter() - t0

    timed(1 + steps)  # warm-up
    best = min(timed(1 + steps) - timed(1) for _ in range(repeats))
    return len(prompts) * steps / best


def measure(a: argparse.Namespace, tp: int, prompts: dict[int, list[list[int]]]) -> dict:
    with Engine(**engine_flags(a, tp)) as engine:
        return {f"decode_bs{b}_tok_s": decode_tok_s(engine, prompts[b], a.steps, a.repeats)
                for b in a.batch_sizes}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-config", default="llama-3.1-8b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,64", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=256, help="decode steps timed per call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mem-fraction-static", type=float, default=0.8)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rng = random.Random(0)
    from radix_runtime.model_source import resolve_model
    from radix_runtime.worker.model_config import load_hf_config

    lo, hi = safe_token_range(
        load_hf_config(resolve_model(a.model_config, "dummy", a.model_config).path).vocab_size
    )
    prompts = {
        b: [[rng.randrange(lo, hi) for _ in range(a.prompt_len)] for _ in range(b)]
        for b in a.batch_sizes
    }
    runs = {f"tp{a.tp}": measure(a, a.tp, prompts), "tp1": measure(a, 1, prompts)}
    ratios = {
        f"decode_bs{b}_speedup": runs[f"tp{a.tp}"][f"decode_bs{b}_tok_s"]
        / runs["tp1"][f"decode_bs{b}_tok_s"]
        for b in a.batch_sizes
    }
    result = {
        "provenance": provenance(
            "--tp 1 on one GPU of the same machine, same run (goal: batch-1 speed-up >= 1.6 at tp 2)",
            {f"tp{t}": engine_flags(a, t) for t in (a.tp, 1)},
            argv,
        ),
        "config": vars(a),
        "runs": runs,
        "ratios": ratios,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
