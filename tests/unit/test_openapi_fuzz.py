"""A schema-driven fuzz test of the served API: request bodies generated from the schema in
/openapi.json (`from_schema` below), some of them then broken on purpose, sent to the real app
(over the real manager and a scripted scheduler, tests/http_support.py: the HTTP layer,
validation, the manager and the renderers are the product's own).
Every answer must be below 500 and conform to the schema the same document declares for its
status: the response shape for a 200, the OpenAI error body for a 4xx. Bounded: EXAMPLES bodies
per route."""

from __future__ import annotations

import jsonschema
import pytest
from http_support import new_manager_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radix_runtime.config import ServerArgs
from radix_runtime.server.http_server import build_app

EXAMPLES = 150
ROUTES = ["/v1/chat/completions", "/v1/completions", "/generate"]

# what GET /openapi.json serves (the app's schema needs no running manager)
_SCHEMA = build_app(new_manager_for("/nonexistent"), ServerArgs()).openapi()
_COMPONENTS = _SCHEMA["components"]["schemas"]


# NOTE: hypothesis-jsonschema (0.23) does not run on this hypothesis (6.17x), so this is the
# subset of JSON Schema that msgspec writes: type, properties/required, items,
# additionalProperties, anyOf, $ref, enum.
def from_schema(schema: dict, depth: int = 0) -> st.SearchStrategy:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(_COMPONENTS[name], depth + 1))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, depth) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        if not props:  # a dict: string keys, values of additionalProperties
            values = schema.get("additionalProperties", {"type": "number"})
            if values is True or values == {}:
                values = {"type": "string"}
            return st.dictionaries(st.text(max_size=4), from_schema(values, depth + 1), max_size=3)
        required = set(schema.get("required", []))
        optional = {k: v for k, v in props.items() if k not in required}
        # deep optional fields rarely: they multiply the size of a body
        return st.fixed_dictionaries(
            {k: from_schema(props[k], depth + 1) for k in required},
            optional={k: from_schema(v, depth + 1) for k, v in optional.items()}
            if depth < 2
            else {},
        )
    if kind == "array":
        items = schema.get("items", {"type": "integer"})
        return st.lists(from_schema(items, depth + 1), max_size=3)
    if kind == "string":
        return st.text(max_size=8)
    if kind == "integer":
        return st.integers(-5, 70) | st.integers()
    if kind == "number":
        return st.floats(-3, 3, allow_nan=False) | st.integers(-3, 3)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return st.none() | st.integers(0, 999) | st.text(max_size=4) | st.lists(st.integers(0, 999))


def _operation(path: str) -> dict:
    return _SCHEMA["paths"][path]["post"]


def _request_schema(path: str) -> dict:
    return _operation(path)["requestBody"]["content"]["application/json"]["schema"]


def _response_schema(path: str, status: int) -> dict:
    """A standalone JSON schema (for jsonschema): the document's components under $defs."""
    content = _operation(path)["responses"][str(status)]["content"]["application/json"]
    return _rewrite_refs({**content["schema"], "$defs": _COMPONENTS})


def _rewrite_refs(node):
    if isinstance(node, dict):
        return {
            k: (v.replace("#/components/schemas/", "#/$defs/") if k == "$ref" else _rewrite_refs(v))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rewrite_refs(v) for v in node]
    return node


# Keep generated bodies small: long strings and lists only slow the test down.
_small = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def _mutate(body: dict, how: int, draw_value):
    """Break a schema-valid body on purpose: drop a field, or give one a wrong-typed value."""
    if not body:
        return body
    key = sorted(body)[how % len(body)]
    out = dict(body)
    if how % 2:
        out.pop(key)
    else:
        out[key] = draw_value
    return out


# a valid minimal body per route: schema-generated fields are laid over it, so that both valid
# requests (200) and refused ones (4xx) come up
MINIMAL = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "abc", "max_tokens": 3},
    "/generate": {"text": "abc", "sampling_params": {"max_new_tokens": 3}},
}


def _fields(path: str) -> dict[str, st.SearchStrategy]:
    schema = _COMPONENTS[_request_schema(path)["$ref"].rsplit("/", 1)[-1]]
    return {k: from_schema(v, 1) for k, v in schema["properties"].items() if k != "stream"}


@pytest.mark.parametrize("path", ROUTES)
def test_schema_generated_requests_never_5xx_and_every_answer_conforms(server, path):
    fields = _fields(path)
    # NOTE: built once: jsonschema.validate() would check the schema itself on every call
    ok = jsonschema.Draft202012Validator(_response_schema(path, 200))
    error = jsonschema.Draft202012Validator(_response_schema(path, 400))
    statuses: dict[int, int] = {}

    @_small
    @given(
        names=st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True),
        data=st.data(),
        drop=st.booleans(),
        junk=st.sampled_from([None, -1, 1.5, "x", [], {}, True, 10**20]),
        broken=st.integers(0, 4),
    )
    def check(names, data, drop, junk, broken):
        body = dict(MINIMAL[path])
        for name in names:
            body[name] = data.draw(fields[name], label=name)
        if broken == 0:  # a wrong-typed value or a missing field
            key = sorted(body)[len(names) % len(body)]
            if drop:
                body.pop(key)
            else:
                body[key] = junk
        resp = server.client.post(path, json=body)
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, (body, resp.text)
        if resp.status_code == 200:
            ok.validate(resp.json())
        else:
            assert str(resp.status_code) in _operation(path)["responses"], resp.status_code
            error.validate(resp.json())

    check()
    assert statuses.get(200, 0) > 0, statuses  # some bodies were valid and answered
    assert sum(v for k, v in statuses.items() if k >= 400) > 0, statuses


def test_every_operation_has_its_own_id():
    """GET /openapi.json names each operation once (clients generated from it need that; FastAPI
    warns of a duplicate when one route serves two methods under one generated id)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = build_app(new_manager_for("/nonexistent"), ServerArgs()).openapi()
    ids = [op["operationId"] for ops in schema["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
