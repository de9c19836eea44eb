"""The reliability suite (issue 6): faults, bad input, security and load against the real
multi-process server on the default model (CPU).

Cases that leave the server running share the session's `default_server` (tests/conftest.py);
cases that kill processes start their own with `launch_server`. The numbers each case records
are printed as one table at the end of the run (`docs/reliability.md` shows the last one).
"""

from __future__ import annotations

import reliability_support as support


def pytest_terminal_summary(terminalreporter) -> None:
    if support.RESULTS:
        terminalreporter.section("reliability numbers")
        terminalreporter.write_line(support.format_results())
