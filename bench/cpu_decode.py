"""Decode tok/s of our worker next to Hugging Face `generate`, same weights, same machine, same run.

    python bench/cpu_decode.py [--tokens 32] [--batch 1,8] [--threads N] [--out result.json]

The reference is transformers' LlamaForCausalLM on the default SmolLM2 GGUF (dequantized by
transformers' own GGUF converter); ours is the ModelRunner driven with real ForwardBatch steps.
Greedy decoding, prompt of ~40 tokens, EOS ignored. Prints tok/s and the ratio ours / HF.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import provenance
from radix_runtime import messages as m
from radix_runtime.config import ServerArgs
from radix_runtime.model_source import default_gguf_path
from radix_runtime.worker.model_runner import ModelRunner

PROMPT_LEN = 40


def hf_model(path: str):
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(path)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(folder, gguf_file=name)).float()
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    model.load_state_dict(state["tensors"], strict=False)
    model.tie_weights()
    return model.eval()


def ours_decode_s(runner: ModelRunner, batch: int, tokens: int, page_size: int) -> float:
    """Seconds for `tokens` decode steps of `batch` requests (after their prefill)."""
    total = PROMPT_LEN + tokens + 1
    pages_per = math.ceil(total / page_size)
    reqs, ids = [], []
    for b in range(batch):
        pages = list(range(1 + b * pages_per, 1 + (b + 1) * pages_per))
        prompt = [(17 * b + 31 * i) % 40000 + 100 for i in range(PROMPT_LEN)]
        reqs.append(
            m.ForwardReq(
                slot=b,
                input_ids=m.pack_ids(prompt),
                start_pos=0,
                new_pages=m.pack_ids(pages),
                new_slot=True,
                sampling=m.SamplingParams(temperature=0.0, ignore_eos=True),
            )
        )
    res = runner.forward(m.ForwardBatch(step=1, reqs=reqs))
    ids = [r.next_id for r in res.results]
    t0 = time.perf_counter()
    for step in range(tokens):
        reqs = [
            m.ForwardReq(slot=b, input_ids=m.pack_ids([ids[b]]), start_pos=PROMPT_LEN + step)
            for b in range(batch)
        ]
        ids = [r.next_id for r in runner.forward(m.ForwardBatch(step=2 + step, reqs=reqs)).results]
    elapsed = time.perf_counter() - t0
    runner.forward(m.ForwardBatch(step=0, reqs=[], released_slots=list(range(batch))))
    return elapsed


def hf_decode_s(model, batch: int, tokens: int) -> float:
    prompt = torch.tensor(
        [[(17 * b + 31 * i) % 40000 + 100 for i in range(PROMPT_LEN)] for b in range(batch)]
    )

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t0

    gen(2)  # warm-up
    return gen(tokens + 1) - gen(1)  # decode only: subtract the prefill + first token


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    path = default_gguf_path()
    server_args = ServerArgs(
        max_total_tokens=max(batches) * (PROMPT_LEN + args.tokens + 16),
        device="cpu",
        max_running_requests=max(batches),
    )
    runner = ModelRunner(server_args)
    model = hf_model(path)
    rows = []
    for batch in batches:
        ours_decode_s(runner, batch, 4, server_args.page_size)  # warm-up
        ours = (
            batch * args.tokens / ours_decode_s(runner, batch, args.tokens, server_args.page_size)
        )
        hf = batch * args.tokens / hf_decode_s(model, batch, args.tokens)
        rows.append(
            {"batch": batch, "ours_tok_s": ours, "hf_generate_tok_s": hf, "ours_over_hf": ours / hf}
        )
    print(
        f"\nSmolLM2-135M decode on CPU, {torch.get_num_threads()} threads, float32, {args.tokens} tokens"
    )
    print(f"{'batch':>5} {'ours tok/s':>11} {'HF tok/s':>9} {'ours/HF':>8}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ours_tok_s']:>11.1f} {r['hf_generate_tok_s']:>9.1f} {r['ours_over_hf']:>8.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "provenance": provenance(
                        "Hugging Face transformers generate() on the same weights, in the same run"
                    ),
                    "threads": torch.get_num_threads(),
                    "tokens": args.tokens,
                    "rows": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
