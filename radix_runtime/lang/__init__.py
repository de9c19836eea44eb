"""The frontend DSL: SGLang-style LLM programs over a radix_runtime server.

    import radix_runtime as rr

    @rr.function
    def qa(s, question):
        s += rr.system("You are a helpful assistant.")
        s += rr.user(question)
        s += rr.assistant(rr.gen("answer", max_tokens=64))

    with rr.Runtime() as runtime:
        print(qa.run(question="What is the capital of France?", backend=runtime)["answer"])

See docs/frontend.md.
"""

from radix_runtime.lang.backend import Backend, RoleMarkers, RuntimeEndpoint, ServerError
from radix_runtime.lang.ir import assistant, gen, select, system, user
from radix_runtime.lang.program import (
    Program,
    function,
    get_default_backend,
    set_default_backend,
)
from radix_runtime.lang.runtime import Runtime
from radix_runtime.lang.state import ForkGroup, ProgramState

__all__ = [
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
]
