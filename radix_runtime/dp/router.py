"""SGLang's router as a child process: `python -m radix_runtime.dp.router`, started by the
supervisor with its settings (sglang_router's RouterArgs fields) as a JSON line on stdin."""

from __future__ import annotations

import dataclasses
import shlex
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


def build_router_args(settings: dict, extra: str = ""):
    """sglang_router's RouterArgs: `settings` (the supervisor's), then the flags given in
    `extra` (--router-args, the router's own CLI syntax) on top. A bad flag raises ValueError."""
    from sglang_router.launch_router import parse_router_args
    from sglang_router.router_args import RouterArgs

    explicit = {}
    if extra.strip():
        try:
            given = dataclasses.asdict(parse_router_args(shlex.split(extra)))
        except SystemExit:  # argparse printed why
            raise ValueError(f"--router-args {extra!r}: not sglang-router flags") from None
        defaults = dataclasses.asdict(parse_router_args([]))
        explicit = {k: v for k, v in given.items() if v != defaults[k]}
    return RouterArgs(**{**settings, **explicit})


def main() -> None:
    payload = read_child_payload()
    set_process_title("router")
    if not router_installed():
        sys.exit(MISSING)
    from sglang_router.launch_router import launch_router

    # blocks until SIGINT / SIGTERM
    launch_router(build_router_args(payload["router"], payload.get("extra", "")))


if __name__ == "__main__":
    main()
