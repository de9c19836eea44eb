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
import threading
from typing import Any

import msgspec

from radix_runtime.config import ServerArgs
from radix_runtime.frontend.builders import InputBuilder
from radix_runtime.frontend.errors import ApiError, GenerationError
from radix_runtime.frontend.generations import Generations
from radix_runtime.frontend.schemas import NativeGenerateRequest, decode_request
from radix_runtime.launch import Children, load_frontend
from radix_runtime.model_source import resolve_model
from radix_runtime.server.tokenizer_manager import TokenizerManager
from radix_runtime.worker.model_config import preflight


class Engine:
    def __init__(self, model: str = "default", **server_args: Any):
        self.args = ServerArgs(model=model, **server_args)
        self.args.validate()
        # refuse an unsupported model before any child process starts
        preflight(resolve_model(self.args.model, self.args.load_format, self.args.model_config))
        self.children = Children(self.args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="engine-loop", daemon=True
        )
        self._thread.start()
        try:
            source, tokenizer = load_frontend(self.args)
            self.manager = TokenizerManager(
                self.args, tokenizer, source.name, source.path, self.children.ipc_dir
            )
            self.children.watch(
                lambda role, code: self._loop.call_soon_threadsafe(
                    self.manager.fail, f"the {role} process exited with code {code}"
                )
            )
            self._call(self.manager.start())
        except BaseException:
            self.shutdown()
            raise
        self.builder = InputBuilder(self.manager, self.args)

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
        return self._call(self.manager.server_info())

    def flush_cache(self) -> bool:
        """Drop every cached prefix that no running request holds."""
        return self._call(self.manager.flush_cache())["success"]

    def shutdown(self) -> None:
        manager = getattr(self, "manager", None)
        if manager is not None and self._loop.is_running() and manager.healthy:
            try:
                self._call(manager.close())
            except Exception:
                pass
        self.children.shutdown()
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
