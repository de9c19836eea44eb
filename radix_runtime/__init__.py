"""radix_runtime: an SGLang-style LLM serving runtime around a radix tree of KV-cache pages."""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy: `import radix_runtime` must stay cheap (the scheduler process is torch-free)
    if name == "Engine":
        from radix_runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'radix_runtime' has no attribute {name!r}")
