"""The routes that let a person watch the cache work (docs/metrics.md):

- ``GET /metrics``: Prometheus text format (``server/metrics.py``); absent with --disable-metrics;
- ``POST /flush_cache`` (SGLang's name, GET too) and ``POST /reset_prefix_cache`` (vLLM's):
  drop every unlocked node of the radix tree and say what was dropped;
- ``GET /cache_tree``: the tree's top levels as JSON, bounded in depth, width and work;
- ``GET /dashboard``: a static page (HTML + JavaScript, no build step, nothing from a CDN) that
  polls the three routes above. The page itself holds no data, so it is served without a key;
  behind --api-key it asks for the key and sends it in the Authorization header.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from radix_runtime.config import ServerArgs
from radix_runtime.frontend.errors import ApiError
from radix_runtime.messages import CacheTree, unpack_ids
from radix_runtime.server.metrics import CONTENT_TYPE

DASHBOARD = Path(__file__).with_name("static") / "dashboard.html"

# /cache_tree bounds: (default, max)
TREE_LIMITS = {"max_depth": (4, 8), "max_children": (8, 32), "max_nodes": (20000, 200000)}
PREVIEW_CHARS = 48

_json = msgspec.json.Encoder()


def _json_response(obj: Any, status: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status, media_type="application/json")


def _tree_params(request: Request) -> dict[str, int]:
    out = {}
    for name, (default, most) in TREE_LIMITS.items():
        raw = request.query_params.get(name)
        if raw is None:
            out[name] = default
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ApiError(f"{name} must be an integer", param=name) from None
        if not 1 <= value <= most:
            raise ApiError(f"{name} must be in [1, {most}]", param=name)
        out[name] = value
    return out


def tree_json(tree: CacheTree, tokenizer: Any) -> dict:
    """Nest the scheduler's flat node list; decode each edge's first tokens for a preview."""
    nodes = []
    for node in tree.nodes:
        ids = unpack_ids(node.head).tolist() if node.head else []
        text = ""
        if ids and tokenizer is not None:
            try:
                text = tokenizer.decode(ids, skip_special_tokens=False)[:PREVIEW_CHARS]
            except Exception:  # a preview is best effort; ids are shown without a tokenizer
                text = ""
        nodes.append(
            {
                "tokens": node.tokens,
                "subtree_tokens": node.subtree_tokens,
                "pages": node.pages,
                "locked": node.locked,
                "age": node.age,
                "head_ids": ids,
                "text": text,
                "other_children": node.other_children,
                "other_tokens": node.other_tokens,
                "children": [],
            }
        )
        if node.parent >= 0:
            nodes[node.parent]["children"].append(nodes[-1])
    return {
        "total_nodes": tree.total_nodes,
        "visited": tree.visited,
        "truncated": tree.truncated,
        "root": nodes[0] if nodes else None,
    }


def install_observability_routes(app: FastAPI, manager: Any, args: ServerArgs) -> None:
    async def flush() -> Response:
        done = await manager.flush_cache()
        if not done["success"]:
            raise ApiError(
                done.get("message") or "cannot flush the cache now",
                status=409,
                code="cache_busy",
            )
        done["message"] = (
            f"dropped {done['dropped_nodes']} nodes ({done['dropped_tokens']} tokens); "
            f"{done['kept_pages']} pages stay with running requests"
        )
        return _json_response(done)

    # one operation id per method and path (OpenAPI needs them unique)
    app.add_api_route("/flush_cache", flush, methods=["POST"], operation_id="flush_cache")
    app.add_api_route("/flush_cache", flush, methods=["GET"], operation_id="flush_cache_get")
    app.add_api_route(
        "/reset_prefix_cache", flush, methods=["POST"], operation_id="reset_prefix_cache"
    )

    @app.get("/cache_tree")
    async def cache_tree(request: Request) -> Response:
        params = _tree_params(request)
        tree = await manager.cache_tree(**params)
        return _json_response(tree_json(tree, manager.tokenizer))

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(
            DASHBOARD.read_bytes(),
            media_type="text/html; charset=utf-8",
            headers={"Cache-Control": "no-cache"},
        )

    if args.disable_metrics:
        return

    @app.get("/metrics")
    async def metrics() -> Response:
        collected = getattr(manager, "metrics", None)
        if collected is None:  # not started yet
            raise ApiError("metrics are not ready", status=503, code="unavailable")
        if manager.healthy:
            await manager.refresh_metrics()
        # NOTE: a server whose child died still shows what it counted before
        return Response(collected.exposition(), media_type=CONTENT_TYPE)
