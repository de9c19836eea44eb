"""Where one CPU step's time goes, in-process: a fresh prompt's prefill and a cached turn's chunk.

    OMP_NUM_THREADS=2 python bench/cpu_step_parts.py [--formats float32,int4] [--threads 1,2]
                                                    [--rounds 5] [--out docs/results/...json]

One `ModelRunner` per weight format (the server's worker: `--device cpu --cpu-weight-format F`,
its C++ decoder), the default model, real text (bench/cpu_decode.py's `long_prompt`, tokenized
as the server does). Two steps:

- prefill: the prompt (~890 tokens) new to the pool, in one step (the server's chunk is 1,024);
- cached turn: the prompt plus a short question, all but the question's tokens already in the
  pool (a chat's next turn: ~9 new tokens over ~900 cached, their pages after the prefix's).

Per thread count, each round times, formats and parts alternating:

- `step`: `ModelRunner.forward` of the whole step (plan, layers, LM head, sampling);
- `products`: the 30 layers' four projections (qkv, o, gate_up, down) on that many rows of
  random activations, the model's own layers (so the format's kernels), and each of the four;
- `attention`: the 30 layers' attention as the step runs it: ATen's flash SDPA (causal, GQA)
  over the prompt for the prefill, `_cpu_decoder.chunk_attention` through the pool locations
  for the cached turn;
- `lm_head`: the LM head on the one row a step samples from;
- `rest`: the step minus the three (RMSNorm, RoPE and the KV store, SiLU-and-mul, residual
  adds, the runner's Python, sampling).

The parts are called one at a time from Python; with more than one thread each call is a
parallel region of its own, whose worker threads may have gone to sleep in between (the
server's OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=10000, which this bench sets like the server
does unless they are set), while the step's regions follow each other within microseconds. So
the parts add up to the step at one thread; at two, `rest` can come out negative and only the
step is the server's number. Medians and min of the rounds; the machine's drift between rounds
is large (read the spread), which is why parts and formats alternate.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radix_runtime.utils.procs import child_env

os.environ.update(child_env())  # the worker's OpenMP waits (before torch starts its threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import provenance  # noqa: E402
from bench.cpu_decode import long_prompt  # noqa: E402
from radix_runtime import messages as m  # noqa: E402
from radix_runtime.config import ServerArgs  # noqa: E402
from radix_runtime.tokenizer.tokenizer import load_tokenizer  # noqa: E402
from radix_runtime.worker import cpu_native  # noqa: E402
from radix_runtime.worker.model_runner import ModelRunner  # noqa: E402

GREEDY = m.SamplingParams(temperature=0.0, max_new_tokens=1 << 20)
QUESTION = "\nQuestion: and in one word?"
PROJECTIONS = ("qkv", "o", "gate_up", "down")


class StepParts:
    """One format's runner, its two steps and their parts as callables."""

    def __init__(self, fmt: str, prompt: list[int], turn: list[int], cached: int) -> None:
        self.fmt = fmt
        args = ServerArgs(
            model="default", device="cpu", cpu_weight_format=fmt, max_total_tokens=16384
        )
        self.runner = r = ModelRunner(args)
        self.ext = cpu_native.load_extension()
        self.step_no = 0
        c = r.config
        self.heads, self.kv_heads, self.dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = r.attn.scale
        layers = r.model.model.layers
        self.num_layers = len(layers)
        self.proj = {
            "qkv": [layer.self_attn.qkv_proj for layer in layers],
            "o": [layer.self_attn.o_proj for layer in layers],
            "gate_up": [layer.mlp.gate_up_proj for layer in layers],
            "down": [layer.mlp.down_proj for layer in layers],
        }
        # the prefill's pages: 1..n (one run); the turn's prefix after them, its new tokens apart
        n = len(prompt)
        self.prefill = m.ForwardReq(
            slot=0,
            input_ids=m.pack_ids(prompt),
            start_pos=0,
            new_pages=m.pack_ids(list(range(1, 1 + n))),
            new_slot=True,
            sampling=GREEDY,
        )
        base = n + 1
        prefix_pages = list(range(base, base + cached))
        new_pages = list(range(base + cached + 64, base + cached + 64 + len(turn) - cached))
        self._forward(  # the turn's cached prefix, in its own slot
            m.ForwardReq(
                slot=1,
                input_ids=m.pack_ids(turn[:cached]),
                start_pos=0,
                new_pages=m.pack_ids(prefix_pages),
                new_slot=True,
                sample=False,
                sampling=GREEDY,
            )
        )
        self.turn = m.ForwardReq(
            slot=2,
            input_ids=m.pack_ids(turn[cached:]),
            start_pos=cached,
            new_pages=m.pack_ids(prefix_pages + new_pages),
            new_slot=True,
            sampling=GREEDY,
        )
        self.turn_locs = torch.tensor(prefix_pages + new_pages)  # page size 1: a page a token
        self.cached = cached
        self.rows = {"prefill": n, "cached_turn": len(turn) - cached}

    def _forward(self, req: m.ForwardReq) -> None:
        self.step_no += 1
        self.runner.forward(m.ForwardBatch(step=self.step_no, reqs=[req]))

    def set_threads(self, threads: int) -> None:
        """The runner sets a step's threads itself (`_cpu_threads_for`): every step on these."""
        self.runner.threads = self.runner.small_step_threads = threads
        torch.set_num_threads(threads)

    def parts(self, step: str) -> dict:
        """name -> a callable timing that part once (seconds)."""
        rows = self.rows[step]
        c = self.runner.config
        dtype = self.runner.dtype
        x = {k: torch.randn(rows, k, dtype=dtype) for k in (c.hidden_size, c.intermediate_size)}
        fns = {"step": lambda: self._forward(self.prefill if step == "prefill" else self.turn)}
        for name in PROJECTIONS:
            fns[name] = lambda layers=self.proj[name]: [p(x[_in_features(p)]) for p in layers]
        q = torch.randn(rows, self.heads, self.dim, dtype=dtype)
        pool = self.runner.kv_pool
        if step == "prefill":
            k, v = (torch.randn(rows, self.kv_heads, self.dim, dtype=dtype) for _ in range(2))
            q_c = q.transpose(0, 1).unsqueeze(0)

            def attention():  # torch_native: the prompt's keys a view of the pool, causal
                for _ in range(self.num_layers):
                    k_c, v_c = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
                    F.scaled_dot_product_attention(
                        q_c, k_c, v_c, is_causal=True, scale=self.scale, enable_gqa=True
                    )
        else:

            def attention():  # the pool's keys, written by the prefix's step
                for i in range(self.num_layers):
                    self.ext.chunk_attention(
                        q, pool.k_flat(i), pool.v_flat(i), self.turn_locs, self.cached, self.scale
                    )

        fns["attention"] = attention
        hidden = torch.randn(1, c.hidden_size, dtype=dtype)
        fns["lm_head"] = lambda: self.runner.model.compute_logits(hidden)

        def timed(fn):
            def run() -> float:
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0

            return run

        return {name: timed(fn) for name, fn in fns.items()}


def _in_features(layer: torch.nn.Module) -> int:
    return layer.in_features if hasattr(layer, "in_features") else layer.weight.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--formats", default="float32,int4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if cpu_native.load_extension() is None:
        sys.exit("the _cpu_decoder extension is not built (python setup.py build_ext --inplace)")
    tok = load_tokenizer("default")
    prompt = list(tok.encode(long_prompt("step parts")))
    turn = list(tok.encode(long_prompt("step parts turn") + QUESTION))
    cached = len(list(tok.encode(long_prompt("step parts turn"))))
    engines = [StepParts(f, prompt, turn, cached) for f in args.formats.split(",")]
    gc.collect()
    gc.freeze()  # as the server's worker does once it is ready
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        for e in engines:
            e.set_threads(threads)
        for step in ("prefill", "cached_turn"):
            fns = {e.fmt: e.parts(step) for e in engines}
            times = {(f, p): [] for f in fns for p in fns[f]}
            for f in fns:  # warm-up
                for fn in fns[f].values():
                    fn()
            for _ in range(args.rounds):
                for f in fns:
                    for p, fn in fns[f].items():
                        times[f, p].append(fn() * 1e3)
            for e in engines:
                f = e.fmt
                med = {p: statistics.median(times[f, p]) for p in fns[f]}
                med["products"] = sum(med[p] for p in PROJECTIONS)
                med["rest"] = med["step"] - med["products"] - med["attention"] - med["lm_head"]
                row = {
                    "format": f,
                    "threads": threads,
                    "step": step,
                    "rows": e.rows[step],
                    "cached": e.cached if step == "cached_turn" else 0,
                    **{f"{p}_ms": v for p, v in med.items()},
                    "step_min_ms": min(times[f, "step"]),
                    "step_spread_ms": [min(times[f, "step"]), max(times[f, "step"])],
                }
                rows.append(row)
                print(
                    f"{f:>8} {threads}t {step:>11} ({row['rows']} rows): step {med['step']:7.1f} "
                    f"ms (min {row['step_min_ms']:.1f})  products {med['products']:6.1f} ("
                    + " ".join(f"{p} {med[p]:.1f}" for p in PROJECTIONS)
                    + f")  attention {med['attention']:6.1f}  lm_head {med['lm_head']:4.1f}  "
                    f"rest {med['rest']:6.1f}",
                    flush=True,
                )
    if args.out:
        result = {
            "provenance": provenance("none: the parts of the step measured in the same run"),
            "omp": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
            "prompt_tokens": len(prompt),
            "turn": {"cached": cached, "new": len(turn) - cached},
            "rounds": args.rounds,
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
