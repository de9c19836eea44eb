"""One data-parallel replica: `python -m radix_runtime.dp.replica`, started by the supervisor.

A whole `radix-runtime serve` (its own scheduler and worker children) whose config arrives as a
JSON line on stdin like every child's (the API key never shows up in `ps`), pinned to its share
of the host's CPUs, dying with the supervisor.
"""

from __future__ import annotations

import os
import sys

from radix_runtime.config import ServerArgs
from radix_runtime.utils.procs import read_child_payload


def main() -> None:
    payload = read_child_payload()
    cpus = payload.get("cpus")
    if cpus:
        os.sched_setaffinity(0, cpus)  # inherited by the replica's scheduler and worker
    from radix_runtime.server.run import run_server

    sys.exit(run_server(ServerArgs.from_json(payload["args"])))


if __name__ == "__main__":
    main()
