"""Offline use without HTTP: the same scheduler and worker processes, driven from Python.

    from radix_runtime import Engine
    with Engine(model="default") as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        out["text"], out["meta_info"]["cached_tokens"]

`generate` takes what the native `/generate` route takes (text or input_ids, one or a batch,
`sampling_params` as a dict) and returns the same JSON-shaped dicts; validation errors raise
`ValueError` with the HTTP layer's message: both build their inputs with
`frontend.builders.InputBuilder`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import msgspec

from radix_runtime.config import ServerArgs
from radix_runtime.dp.replica_set import ReplicaSet
from radix_runtime.dp.supervisor import (
    ReplicaPlan,
    plan_replicas,
    replicas_share_a_gpu,
    visible_gpus,
)
from radix_runtime.frontend.builders import InputBuilder
from radix_runtime.frontend.errors import ApiError, GenerationError
from radix_runtime.frontend.generations import Generations
from radix_runtime.frontend.schemas import NativeGenerateRequest, decode_request
from radix_runtime.launch import Children, load_frontend
from radix_runtime.model_source import resolve_model
from radix_runtime.server.tokenizer_manager import TokenizerManager
from radix_runtime.worker.model_config import preflight


class Engine:
    """``Engine(model, dp=N, **server_flags)``: with ``dp`` > 1, N replicas of the scheduler and
    worker (one GPU each, or an equal share of the CPU cores, as ``serve --dp N`` places them),
    each generation going to the least busy replica (dp/replica_set.py)."""

    def __init__(self, model: str = "default", **server_args: Any):
        self.args = ServerArgs(model=model, **server_args)
        self.args.validate()
        # refuse an unsupported model before any child process starts
        preflight(resolve_model(self.args.model, self.args.load_format, self.args.model_config))
        self.replicas: list[Children] = []
        self.managers: list[TokenizerManager] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="engine-loop", daemon=True
        )
        self._thread.start()
        try:
            source, tokenizer = load_frontend(self.args)
            plans = self._placement()
            one_by_one = replicas_share_a_gpu(plans)  # as serve --dp starts them
            for plan in plans:
                children = Children(plan.args, env=plan.env, cpus=plan.cpus)
                self.replicas.append(children)
                manager = TokenizerManager(
                    plan.args, tokenizer, source.name, source.path, children.ipc_dir
                )
                self.managers.append(manager)
                children.watch(
                    lambda role, code, manager=manager: self._loop.call_soon_threadsafe(
                        manager.fail, f"the {role} process exited with code {code}"
                    )
                )
                if one_by_one:
                    self._call(manager.start())
            if not one_by_one:
                self._call(self._start_all())
        except BaseException:
            self.shutdown()
            raise
        self.manager = self.managers[0] if len(self.managers) == 1 else ReplicaSet(self.managers)
        self.builder = InputBuilder(self.manager, self.args)

    async def _start_all(self) -> None:
        await asyncio.gather(*(m.start() for m in self.managers))

    def _placement(self) -> list[ReplicaPlan]:
        if self.args.dp == 1:
            return [ReplicaPlan(0, self.args)]
        cpus = sorted(os.sched_getaffinity(0))
        # ports: none is opened (no HTTP in the Engine)
        return plan_replicas(self.args, visible_gpus(self.args.device), cpus, [0] * self.args.dp)

    @property
    def tokenizer(self):
        return self.manager.tokenizer

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> dict | list[dict]:
        body = {
            "text": prompt,
            "input_ids": input_ids,
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
        }
        try:
            req = decode_request(msgspec.json.encode(body), NativeGenerateRequest)
            inputs, renderer = self.builder.native(req)
            run = Generations(self.manager, inputs)
            try:
                states = await run.collect()
            finally:
                run.close()
        except ApiError as exc:
            raise ValueError(f"{exc.message} (param: {exc.param})") from None
        except GenerationError as exc:
            raise ValueError(exc.message) from None
        return renderer.response(states)

    def generate(self, prompt=None, sampling_params=None, **kwargs) -> dict | list[dict]:
        return self._call(self.async_generate(prompt, sampling_params, **kwargs))

    def server_info(self) -> dict:
        """The scheduler's state; with ``dp`` > 1, ``{"dp": N, "replicas": [...]}`` (a dead
        replica: ``healthy`` false and why)."""
        return self._call(self.manager.server_info())

    def flush_cache(self) -> bool:
        """Drop every cached prefix that no running request holds."""
        return self._call(self.manager.flush_cache())["success"]

    def shutdown(self) -> None:
        running = self._loop.is_running()
        for manager in getattr(self, "managers", []):
            # (a dead replica's sockets too: an open zmq context blocks the interpreter's exit)
            if running and getattr(manager, "ctx", None) is not None:
                try:
                    self._call(manager.close())
                except Exception:
                    pass
        for children in getattr(self, "replicas", []):
            children.shutdown()
        if running:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
