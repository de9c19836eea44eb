"""The HTTP front alone at a loaded server's event rate: what the tokenizer process does to ITL.

A server whose scheduler is a paced script: the real app and `TokenizerManager` on uvicorn and
uvloop, set up as `radix-runtime serve` sets them up (its garbage-collector setup included), and
a scheduler thread on the manager's sockets that admits up to --streams requests and every
--step-ms sends one BatchOutput with one token for each running request, until each has its
max_new_tokens. No model: the step time is fixed, so whatever spreads the ITL beyond it is the
front's (its event loop, its garbage collections) or the client's. `bench/serving.py --url` is the
client; its summary lines (ITL p50 / p99, `gc during the run`) are printed, its JSON written
with --out.

    python bench/front_stream.py --streams 256 --step-ms 50 --num-prompts 256 \\
        --input-len 1000 --output-len 1000
    python bench/front_stream.py ... --server-args "--disable-gc-freeze"

Measured so (docs/serving_roofline.md, "What sets ITL p99 under the burst"): the H200 burst's
256 streams at ~18 ms steps are ~14k events a second; on a small CPU machine a 50 ms step keeps
the client and the front within their cores.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make `bench` and the package importable
    sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

VOCAB = 32000
CONTEXT = 1 << 20


class PacedScheduler:
    """The scheduler's ends of the manager's sockets: admits requests in arrival order, up to
    `streams` at once; every `step_s` one token (id 100..999) for each running one."""

    def __init__(self, ipc_dir: str, streams: int, step_s: float) -> None:
        import zmq

        from radix_runtime import messages as m
        from radix_runtime.utils.procs import endpoint, zmq_socket

        self.m, self.streams, self.step_s = m, streams, step_s
        self.ctx = zmq.Context()
        self.inbox = zmq_socket(self.ctx, zmq.PULL, endpoint(ipc_dir, "scheduler"), bind=True)
        self.outbox = zmq_socket(self.ctx, zmq.PUSH, endpoint(ipc_dir, "tokenizer"), bind=False)
        self.waiting: list = []
        self.running: dict[str, list] = {}  # rid -> [GenerateReq, tokens sent]
        self.send(
            m.SchedulerReady(
                max_total_tokens=CONTEXT,
                page_size=1,
                context_length=CONTEXT,
                vocab_size=VOCAB,
                max_running_requests=streams,
            )
        )
        threading.Thread(target=self._loop, name="paced-scheduler", daemon=True).start()

    def send(self, msg) -> None:
        self.outbox.send(self.m.encode(msg))

    def _info(self):
        m = self.m
        cache = m.CacheStats(
            total_pages=1, free_pages=1, evictable_pages=0, protected_pages=0, page_size=1,
            hit_rate=0.0,
        )  # fmt: skip
        return m.ServerInfo(
            cache=cache,
            running_requests=len(self.running),
            waiting_requests=len(self.waiting),
            max_total_tokens=CONTEXT,
            max_running_requests=self.streams,
            context_length=CONTEXT,
            vocab_size=VOCAB,
        )

    def _loop(self) -> None:
        m = self.m
        due = time.perf_counter()
        while True:
            while self.inbox.poll(0):
                msg = m.decode(self.inbox.recv())
                if isinstance(msg, m.GenerateReq):
                    self.waiting.append(msg)
                elif isinstance(msg, m.AbortReq):
                    self.running.pop(msg.rid, None)
                elif isinstance(msg, m.ServerInfoReq):
                    self.send(self._info())
                elif isinstance(msg, m.FlushCacheReq):
                    self.send(m.FlushCacheDone(ok=True))
            while self.waiting and len(self.running) < self.streams:
                req = self.waiting.pop(0)
                self.running[req.rid] = [req, 0]
            if self.running:
                outs = []
                for rid, state in list(self.running.items()):
                    req, sent = state
                    state[1] = sent = sent + 1
                    out = m.ReqOutput(
                        rid=rid,
                        new_ids=m.pack_ids([100 + sent % 900]),
                        prompt_tokens=len(req.input_ids) // 4,
                    )
                    if sent >= req.sampling.max_new_tokens:
                        out.finish_reason = "length"
                        del self.running[rid]
                    outs.append(out)
                self.send(m.BatchOutput(outputs=outs, sent_at=time.perf_counter()))
            due += self.step_s
            time.sleep(max(0.0, due - time.perf_counter()))


async def _serve(args, streams: int, step_s: float) -> None:
    import uvicorn

    from radix_runtime.server.http_server import build_app
    from radix_runtime.server.tokenizer_manager import TokenizerManager
    from radix_runtime.utils import gc_tuning

    ipc_dir = tempfile.mkdtemp(prefix="front-stream-")
    PacedScheduler(ipc_dir, streams, step_s)
    manager = TokenizerManager(args, None, "front-stream", "front-stream", ipc_dir)
    await manager.start()
    app = build_app(manager, args)
    gc_tuning.ready(args, "tokenizer")  # as radix_runtime/server/run.py does
    config = uvicorn.Config(
        app, host="127.0.0.1", port=args.port, log_level="warning", loop="none"
    )  # fmt: skip
    await uvicorn.Server(config).serve()


def serve_main(argv: list[str]) -> int:
    """`--serve PORT STREAMS STEP_MS [server flags]`: the server side (a subprocess)."""
    from radix_runtime.config import parse_server_args
    from radix_runtime.utils.procs import configure_logging

    port, streams, step_ms, *flags = argv
    args = parse_server_args(["--port", port, *flags])
    configure_logging(args.log_level, "tokenizer")
    try:
        import uvloop

        uvloop.run(_serve(args, int(streams), float(step_ms) / 1e3))
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(_serve(args, int(streams), float(step_ms) / 1e3))
    return 0


def _wait_healthy(server: subprocess.Popen, url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the front exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the front was not healthy within {timeout:g}s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256, help="requests streamed at once")
    p.add_argument("--step-ms", type=float, default=50.0, help="one token per stream this often")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--client-procs", type=int, default=1)
    p.add_argument("--server-args", default="", help='front flags, e.g. "--disable-gc-freeze"')
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", help="bench/serving.py's JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve":
        return serve_main(argv[1:])
    opts = build_parser().parse_args(argv)
    port = common.free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), str(opts.streams), str(opts.step_ms)]
        + shlex.split(opts.server_args),
        cwd=ROOT,
        preexec_fn=common._die_with_parent,  # noqa: PLW1509 - as LaunchedServer: never orphaned
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(server, url, timeout=120)
        cmd = [
            sys.executable, str(ROOT / "bench" / "serving.py"), "--url", url,
            "--num-prompts", str(opts.num_prompts),
            "--random-input-len", str(opts.input_len),
            "--random-output-len", str(opts.output_len),
            "--random-range-ratio", "1.0", "--rates", "inf", "--no-roofline",
            "--client-procs", str(opts.client_procs),
        ] + (["--out", opts.out] if opts.out else [])  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout, cwd=ROOT)
        lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
        print(f"front flags: {opts.server_args or '(defaults)'}; {opts.streams} streams, one "
              f"token each every {opts.step_ms:g} ms")  # fmt: skip
        print("\n".join(lines[-5:]))
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
        return out.returncode
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
