"""radix_runtime: an SGLang-style LLM serving runtime around a radix tree of KV-cache pages."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"


def __getattr__(name: str):
    # lazy: `import radix_runtime` must stay cheap (the scheduler process is torch-free);
    # the frontend DSL (radix_runtime.lang) is re-exported as rr.function, rr.gen, ...
    if name == "Engine":
        from radix_runtime.engine import Engine

        return Engine
    if not name.startswith("__"):
        # import_module, not `from radix_runtime import lang`: that would ask __getattr__ again
        lang = importlib.import_module("radix_runtime.lang")
        if name in lang.__all__:
            return getattr(lang, name)
    raise AttributeError(f"module 'radix_runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    lang = importlib.import_module("radix_runtime.lang")
    return sorted([*globals(), "Engine", *lang.__all__])
