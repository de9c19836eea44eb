"""The frontend DSL: SGLang-style LLM programs over a radix_runtime server.

    import radix_runtime as rr        # SGLang programs also run as `import radix_runtime as sgl`

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
from radix_runtime.lang.ir import (
    REGEX_BOOL,
    REGEX_FLOAT,
    REGEX_INT,
    REGEX_STR,
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    greedy_token_selection,
    image,
    select,
    separate_reasoning,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
    video,
)
from radix_runtime.lang.program import (
    GlobalConfig,
    Program,
    flush_cache,
    function,
    get_default_backend,
    get_server_info,
    global_config,
    set_default_backend,
)
from radix_runtime.lang.runtime import Runtime
from radix_runtime.lang.state import ForkGroup, ProgramState

__all__ = [
    "REGEX_BOOL",
    "REGEX_FLOAT",
    "REGEX_INT",
    "REGEX_STR",
    "Backend",
    "ForkGroup",
    "GlobalConfig",
    "Program",
    "ProgramState",
    "RoleMarkers",
    "Runtime",
    "RuntimeEndpoint",
    "ServerError",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "image",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
