"""In-process data parallelism for the offline ``Engine(dp=N)``: N replicas (each its own
scheduler and worker children, placed like ``serve --dp N`` places them) behind one object that
the front drives as it drives a single ``TokenizerManager``.

There is no router process: each generation goes to the serving replica with the fewest
generations in flight (round robin among equals), so the prompts of one batch spread evenly.
A replica whose child died stops serving; the others keep answering.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from radix_runtime.frontend.contract import GenerateChunk, GenerateInput
from radix_runtime.frontend.errors import GenerationError


class ReplicaSet:
    """The TokenizerManager interface the front uses (InputBuilder, Generations), over N
    managers of one model."""

    def __init__(self, managers: list[Any]) -> None:
        assert managers
        self.managers = managers
        first = managers[0]
        self.tokenizer = first.tokenizer
        self.model_name = first.model_name
        self.model_path = first.model_path
        self.chat_template = first.chat_template
        self._next = 0
        self._owner: dict[str, Any] = {}  # rid -> the manager running it

    # the model's limits: every replica serves the same model with the same flags
    @property
    def context_length(self) -> int:
        return self.managers[0].context_length

    @property
    def vocab_size(self) -> int:
        return self.managers[0].vocab_size

    @property
    def healthy(self) -> bool:
        return any(m.healthy for m in self.managers)

    def serving_error(self, *, new_work: bool = True) -> GenerationError | None:
        """None while any replica serves; else why the first one does not."""
        errors = [m.serving_error(new_work=new_work) for m in self.managers]
        if any(e is None for e in errors):
            return None
        return errors[0]

    def pick(self) -> Any:
        """The serving replica with the fewest generations in flight (round robin on ties)."""
        n = len(self.managers)
        order = [self.managers[(self._next + i) % n] for i in range(n)]
        serving = [m for m in order if m.serving_error() is None]
        if not serving:
            return self.managers[0]  # its generate() raises why
        chosen = min(serving, key=lambda m: m.num_inflight)
        self._next = (self.managers.index(chosen) + 1) % n
        return chosen

    async def generate(self, inp: GenerateInput) -> AsyncIterator[GenerateChunk]:
        manager = self.pick()
        self._owner[inp.rid] = manager
        try:
            async for chunk in manager.generate(inp):
                yield chunk
        finally:
            self._owner.pop(inp.rid, None)

    async def abort(self, rid: str) -> None:
        manager = self._owner.get(rid)
        if manager is not None:
            await manager.abort(rid)

    async def server_info(self) -> dict:
        """Every replica's info (``replicas[i]``; a dead one: healthy false and why)."""
        replicas = []
        for rank, manager in enumerate(self.managers):
            error = manager.serving_error(new_work=False)
            if error is not None:
                replicas.append({"dp_rank": rank, "healthy": False, "error": error.message})
                continue
            info = await manager.server_info()
            replicas.append({"dp_rank": rank, "healthy": True, **info})
        return {"dp": len(self.managers), "replicas": replicas}

    async def flush_cache(self) -> dict:
        """Flush every serving replica; success only if every one succeeded."""
        serving = [m for m in self.managers if m.serving_error(new_work=False) is None]
        results = await asyncio.gather(*(m.flush_cache() for m in serving))
        return {
            "success": bool(results) and all(r["success"] for r in results),
            "replicas": list(results),
        }

    async def close(self) -> None:
        await asyncio.gather(*(m.close() for m in self.managers), return_exceptions=True)
