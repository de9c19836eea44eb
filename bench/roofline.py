"""The roofline of a serving workload: the least time one device needs for the work the requests
ask for, given its matmul and bandwidth ceilings. Pure arithmetic (numpy), no torch.

Work of a workload (each request: a prompt of I tokens, C of them cached, O output tokens):
- prefill: the matmul FLOPs of the I - C computed prompt tokens (:func:`prefill_flops`: 2 per
  layer weight per token, the LM head on the last row, causal attention over the keys each query
  sees), at the matmul ceiling;
- decode: output tokens 2..O are decode rows (the first comes out of the prefill); each reads the
  KV of its whole context (I + j keys for the j-th) and costs 2 FLOPs per weight; every decode
  *step* reads the weights once. Time = max(bytes / bandwidth, FLOPs / matmul ceiling), summed
  over the decode work (a lower bound on the sum of the steps' own maxima).

The number of decode steps is what separates a server's schedule from the ideal:
- ``steps_ideal``: ceil(decode rows / B) with B the requests the KV pool holds at once at their
  full length (at most all of them), and never fewer than the longest output needs;
- ``steps_run``: the decode steps the server reports for the run (/get_server_info
  ``decode_steps``), i.e. the batch sizes it actually ran.

Output tok/s at the roofline = output tokens / roofline time; the fraction achieved = measured
output tok/s / that. Beside it, :func:`serial_decode_s` gives the decode time of an engine whose
kernels run one after another (no overlap of compute-bound matmuls with bandwidth-bound
attention): ``output_tok_s_serial``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a model: its matmul weights and KV footprint."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    weight_bytes_per_param: float  # 2 for bf16, 4 for float32
    kv_bytes_per_element: float  # the KV pool's element size (1 with fp8 KV)
    # per layer, how many keys a query sees (0 = all); None = every layer sees all
    layer_windows: tuple[int, ...] | None = None

    @property
    def layer_params(self) -> int:
        """Matmul weights of one decoder layer: q, k, v, o, gate, up, down."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def decode_params(self) -> int:
        """Matmul weights of a decode row: every layer's and the LM head."""
        return self.num_layers * self.layer_params + self.lm_head_params

    @property
    def decode_weight_bytes(self) -> float:
        """Weights a decode step reads: every layer's and the LM head (the embedding table only
        one row per token, which is negligible)."""
        return self.decode_params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token_layer(self) -> float:
        return 2 * self.num_kv_heads * self.head_dim * self.kv_bytes_per_element

    @property
    def kv_bytes_per_token(self) -> float:
        return self.num_layers * self.kv_bytes_per_token_layer

    def windows(self) -> tuple[int, ...]:
        return self.layer_windows or (0,) * self.num_layers

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelShape:
        d = dict(d)
        if d.get("layer_windows") is not None:
            d["layer_windows"] = tuple(d["layer_windows"])
        return cls(**d)


def _keys_seen(first: int, last: int, window: int) -> float:
    """Sum over query positions p in [first, last) of the keys it attends to: p + 1, or at most
    `window` (0: no window)."""
    if last <= first:
        return 0.0
    if not window:
        # sum_{p=first}^{last-1} (p + 1)
        return (last * (last + 1) - first * (first + 1)) / 2
    # positions below window - 1 see p + 1 keys, the rest see `window`
    split = min(max(window - 1, first), last)
    return _keys_seen(first, split, 0) + (last - split) * window


def attention_flops(shape: ModelShape, first: int, last: int) -> float:
    """QK^T and PV FLOPs of the queries at positions [first, last), over every layer."""
    per_key = 4 * shape.num_heads * shape.head_dim
    return per_key * sum(_keys_seen(first, last, w) for w in shape.windows())


def prefill_flops(
    shape: ModelShape, n: int, prefix: int = 0, layer_params: int | None = None
) -> float:
    """Matmul FLOPs of n new prompt tokens after `prefix` cached ones (`layer_params`: the
    total of every layer's weights, when the caller counted them on the real model)."""
    if n <= 0:
        return 0.0
    weights = shape.num_layers * shape.layer_params if layer_params is None else layer_params
    return (
        2 * n * weights
        + 2 * shape.hidden_size * shape.vocab_size
        + attention_flops(shape, prefix, prefix + n)
    )


def decode_kv_bytes(shape: ModelShape, prompt: int, output: int) -> float:
    """KV bytes read by a request's decode rows: row j (1..output-1) attends to prompt + j keys
    (per layer at most its window)."""
    if output <= 1:
        return 0.0
    per_layer = shape.kv_bytes_per_token_layer
    # row j's keys = positions 0..prompt+j-1, i.e. "queries" at positions prompt..prompt+output-2
    return per_layer * sum(_keys_seen(prompt, prompt + output - 1, w) for w in shape.windows())


def decode_flops(shape: ModelShape, prompt: int, output: int) -> float:
    """Matmul FLOPs of a request's decode rows: the weights (LM head included) and attention."""
    rows = max(output - 1, 0)
    return 2 * rows * shape.decode_params + attention_flops(shape, prompt, prompt + rows)


def ideal_decode_steps(
    outputs: Sequence[int], all_lens: Sequence[int], pool_tokens: int, page_size: int = 1
) -> int:
    """Decode steps with the largest batches the pool holds: ceil(rows / B), B the number of
    requests whose full-length KV fits at once (pages rounded up), never fewer than the longest
    request's own rows."""
    rows = sum(max(o - 1, 0) for o in outputs)
    if rows == 0:
        return 0
    longest = max(all_lens)
    per_req = math.ceil(longest / page_size) * page_size
    batch = max(1, min(len(outputs), pool_tokens // per_req if per_req else len(outputs)))
    return max(math.ceil(rows / batch), max(outputs) - 1)


@dataclass(frozen=True)
class Ceilings:
    matmul_flops: float  # FLOP/s
    bandwidth: float  # bytes/s (the copy bandwidth: what the goals are stated against)


def workload_roofline(
    shape: ModelShape,
    ceilings: Ceilings,
    requests: Sequence[tuple[int, int, int]],
    decode_steps: int,
) -> dict:
    """The roofline of `requests` ((prompt tokens, cached tokens, output tokens) each) run with
    `decode_steps` decode steps: its times, bytes, FLOPs and output tok/s."""
    p_flops = sum(prefill_flops(shape, i - c, c) for i, c, _ in requests)
    d_flops = sum(decode_flops(shape, i, o) for i, _, o in requests)
    kv_bytes = sum(decode_kv_bytes(shape, i, o) for i, _, o in requests)
    weight_bytes = decode_steps * shape.decode_weight_bytes
    prefill_s = p_flops / ceilings.matmul_flops
    decode_mem_s = (kv_bytes + weight_bytes) / ceilings.bandwidth
    decode_s = max(decode_mem_s, d_flops / ceilings.matmul_flops)
    total_s = prefill_s + decode_s
    output = sum(o for _, _, o in requests)
    serial_s = prefill_s + serial_decode_s(shape, ceilings, requests, decode_steps)
    return {
        "decode_steps": decode_steps,
        "mean_decode_batch": (sum(max(o - 1, 0) for _, _, o in requests) / decode_steps)
        if decode_steps
        else None,
        "prefill_flops": p_flops,
        "decode_flops": d_flops,
        "decode_kv_bytes": kv_bytes,
        "decode_weight_bytes": weight_bytes,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "decode_bound": "bandwidth" if decode_s == decode_mem_s else "matmul",
        "total_s": total_s,
        "output_tokens": output,
        "output_tok_s": output / total_s if total_s > 0 else None,
        "decode_serial_s": serial_s - prefill_s,
        "total_serial_s": serial_s,
        "output_tok_s_serial": output / serial_s if serial_s > 0 else None,
    }


def serial_decode_s(
    shape: ModelShape,
    ceilings: Ceilings,
    requests: Sequence[tuple[int, int, int]],
    decode_steps: int,
) -> float:
    """Decode time when a step's kernels run one after another, each at its own ceiling: per
    step the weight matmuls take max(weight bytes / bandwidth, their FLOPs at the mean batch /
    matmul ceiling), then attention reads every row's KV (max(KV bytes / bandwidth, attention
    FLOPs / matmul ceiling) over the run). :func:`workload_roofline`'s decode time lets the
    compute-bound matmuls and the bandwidth-bound attention overlap; this bound does not, so it is
    what an engine that runs one kernel at a time can reach. The mean batch makes it a lower
    bound on the sum over steps of their own batch sizes (max(a, b x) is convex in x)."""
    rows = sum(max(o - 1, 0) for _, _, o in requests)
    if rows == 0 or decode_steps <= 0:
        return 0.0
    batch = rows / decode_steps
    matmul_step = max(
        shape.decode_weight_bytes / ceilings.bandwidth,
        2 * batch * shape.decode_params / ceilings.matmul_flops,
    )
    kv_bytes = sum(decode_kv_bytes(shape, i, o) for i, _, o in requests)
    attn_flops = sum(attention_flops(shape, i, i + max(o - 1, 0)) for i, _, o in requests)
    attention = max(kv_bytes / ceilings.bandwidth, attn_flops / ceilings.matmul_flops)
    return decode_steps * matmul_step + attention


def fraction(measured: float | None, roofline: float | None) -> float | None:
    if measured is None or not roofline:
        return None
    return measured / roofline
