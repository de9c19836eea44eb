"""Driving the generations of one request through the ``TokenizerManager``.

A request may start several generations (n choices x prompts); ``Generations`` runs them
concurrently and hands out their increments in arrival order. The HTTP routes, /health_generate
and the offline ``Engine`` all drive requests through it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from radix_runtime.frontend.contract import ChoiceState, GenerateChunk, GenerateInput

logger = logging.getLogger(__name__)

_background: set[asyncio.Task] = set()


def spawn(coro: Awaitable[Any]) -> None:
    """Fire and forget, keeping a reference; used for aborts, which must run even while the task
    that asks for them is being cancelled."""

    async def run() -> None:
        try:
            await coro
        except Exception:
            logger.exception("background task failed")

    task = asyncio.get_running_loop().create_task(run())
    _background.add(task)
    task.add_done_callback(_background.discard)


class Generations:
    """The generations of one request, run concurrently; ``next()`` yields their increments
    in arrival order. ``close()`` cancels what is still running and aborts it in the scheduler."""

    def __init__(self, manager: Any, inputs: list[GenerateInput]) -> None:
        self.manager = manager
        self.states = [ChoiceState(i, inp.rid, inp.input_ids) for i, inp in enumerate(inputs)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._running = len(inputs)
        self._unfinished = {inp.rid for inp in inputs}
        self._tasks = [asyncio.create_task(self._pump(i, inp)) for i, inp in enumerate(inputs)]

    async def _pump(self, index: int, inp: GenerateInput) -> None:
        try:
            async for chunk in self.manager.generate(inp):
                self._queue.put_nowait((index, chunk))
        except Exception as exc:
            self._queue.put_nowait((index, exc))
            return
        self._queue.put_nowait((index, None))

    async def next(self) -> tuple[ChoiceState, GenerateChunk] | None:
        """The next increment of any generation; None once all have finished. Raises the first
        GenerationError."""
        while self._running:
            index, item = await self._queue.get()
            state = self.states[index]
            if item is None:  # this generator is exhausted
                self._running -= 1
                self._unfinished.discard(state.rid)
                if state.finish_reason is None:
                    logger.warning("generation %s ended without a finish reason", state.rid)
                    state.finish_reason = "abort"
                continue
            if isinstance(item, Exception):
                self._running -= 1
                self._unfinished.discard(state.rid)  # the manager already dropped it
                raise item
            state.add(item)
            if item.finish_reason is not None:
                self._unfinished.discard(state.rid)
            return state, item
        return None

    async def collect(self) -> list[ChoiceState]:
        while await self.next() is not None:
            pass
        return self.states

    def close(self) -> None:
        """Idempotent, synchronous (safe inside a cancelled task)."""
        for task in self._tasks:
            if not task.done():
                task.cancel()
        for rid in self._unfinished:
            spawn(self.manager.abort(rid))
        self._unfinished.clear()
