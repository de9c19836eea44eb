"""`radix-runtime serve ...` (also `python -m radix_runtime serve ...`)."""

from __future__ import annotations

import argparse
import sys

from radix_runtime.config import add_server_args, args_from_namespace


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radix-runtime", description="LLM serving runtime with a radix-tree KV cache"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_server_args(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        try:
            args = args_from_namespace(ns)
        except ValueError as exc:
            print(f"radix-runtime: {exc}", file=sys.stderr)
            return 2
        from radix_runtime.model_source import ModelNotFound, resolve_model
        from radix_runtime.worker.model_config import UnsupportedModel, preflight

        try:  # before any child process starts
            preflight(resolve_model(args.model, args.load_format, args.model_config))
        except (UnsupportedModel, ModelNotFound) as exc:
            print(f"radix-runtime: {exc}", file=sys.stderr)
            return 2
        if args.dp > 1:
            from radix_runtime.dp.supervisor import run_dp

            return run_dp(args)
        from radix_runtime.server.run import run_server

        return run_server(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
