"""SGLang's router as a child process: `python -m radix_runtime.dp.router`, started by the
supervisor with its settings (sglang_router's RouterArgs fields) as a JSON line on stdin."""

from __future__ import annotations

import sys

from radix_runtime.utils.procs import read_child_payload, set_process_title

MISSING = (
    "--dp needs SGLang's router: pip install 'radix_runtime[router]' (the sglang-router package)"
)


def router_installed() -> bool:
    try:
        from sglang_router.router import Router  # noqa: F401 (the Rust extension)
    except ImportError:
        return False
    return True


def main() -> None:
    payload = read_child_payload()
    set_process_title("router")
    try:
        from sglang_router.launch_router import launch_router
        from sglang_router.router_args import RouterArgs
    except ImportError:
        sys.exit(MISSING)
    launch_router(RouterArgs(**payload["router"]))  # blocks until SIGINT / SIGTERM


if __name__ == "__main__":
    main()
