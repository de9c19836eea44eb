"""The layout keeps its promises: frontend/ is transport-neutral (the HTTP server and the
offline Engine both build on it, so it may import neither HTTP libraries nor server/), and the
Engine drives requests through frontend/ rather than through the HTTP module."""

from __future__ import annotations

import ast
from pathlib import Path

import radix_runtime

PACKAGE = Path(radix_runtime.__file__).parent
HTTP_LIBRARIES = ("fastapi", "starlette", "uvicorn", "httpx", "anyio")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_frontend_imports_neither_http_nor_the_server_package():
    files = sorted((PACKAGE / "frontend").glob("*.py"))
    assert len(files) >= 8
    for path in files:
        for name in imported_modules(path):
            assert not name.startswith("radix_runtime.server"), (path.name, name)
            assert name.split(".")[0] not in HTTP_LIBRARIES, (path.name, name)


def test_engine_does_not_import_the_http_module():
    names = imported_modules(PACKAGE / "engine.py")
    assert "radix_runtime.server.http_server" not in names
    assert {"radix_runtime.frontend.builders", "radix_runtime.frontend.generations"} <= names
