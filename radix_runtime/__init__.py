"""radix_runtime: an SGLang-style LLM serving runtime around a radix tree of KV-cache pages."""

from __future__ import annotations

__version__ = "0.1.0"

# the frontend DSL (radix_runtime.lang), re-exported as rr.function, rr.gen, ...
_LANG_NAMES = frozenset(
    {
        "Backend",
        "ForkGroup",
        "Program",
        "ProgramState",
        "RoleMarkers",
        "Runtime",
        "RuntimeEndpoint",
        "ServerError",
        "assistant",
        "function",
        "gen",
        "get_default_backend",
        "select",
        "set_default_backend",
        "system",
        "user",
    }
)


def __getattr__(name: str):
    # lazy: `import radix_runtime` must stay cheap (the scheduler process is torch-free)
    if name == "Engine":
        from radix_runtime.engine import Engine

        return Engine
    if name in _LANG_NAMES:
        from radix_runtime import lang

        return getattr(lang, name)
    raise AttributeError(f"module 'radix_runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "Engine", *_LANG_NAMES])
