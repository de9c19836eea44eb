"""Cache salts and API-key tenants -> the radix tree namespace each request is sent with
(the HTTP layer over the real manager, read off the GenerateReq a scripted scheduler receives;
tests/integration/test_tenancy_e2e.py runs the real server)."""

from __future__ import annotations

import pytest
from http_support import Served, assert_error, chat_body, served

from radix_runtime.config import ServerArgs
from radix_runtime.frontend.tenancy import cache_namespace, find_tenant, load_tenants

ROUTES = [
    ("/v1/chat/completions", chat_body(max_tokens=2)),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 2}),
    ("/generate", {"text": "abc", "sampling_params": {"max_new_tokens": 2}}),
]


def namespaces_of(s: Served) -> set[str]:
    """The namespaces of the requests the scheduler received since the last call."""
    out = {req.cache_namespace for req in s.sched.requests}
    s.sched.requests.clear()
    return out


@pytest.mark.parametrize("path, body", ROUTES)
def test_salt_names_the_namespace_on_every_route(server, path, body):
    client, manager = server.client, server
    assert client.post(path, json=body).status_code == 200
    assert namespaces_of(manager) == {""}  # no salt: the public namespace
    for field in ("cache_salt", "extra_key"):  # SGLang's name is an alias
        assert client.post(path, json={**body, field: "s3"}).status_code == 200
        assert namespaces_of(manager) == {"salt:s3"}
    both = {**body, "cache_salt": "s3", "extra_key": "s3"}
    assert client.post(path, json=both).status_code == 200
    assert namespaces_of(manager) == {"salt:s3"}


@pytest.mark.parametrize("path, body", ROUTES)
@pytest.mark.parametrize(
    "patch, param",
    [
        ({"cache_salt": ""}, "cache_salt"),
        ({"extra_key": ""}, "extra_key"),
        ({"cache_salt": "x" * 1025}, "cache_salt"),
        ({"cache_salt": 7}, "cache_salt"),
        ({"cache_salt": "a", "extra_key": "b"}, "extra_key"),
    ],
)
def test_bad_salts_are_400(server, path, body, patch, param):
    assert_error(server.client.post(path, json={**body, **patch}), 400, param=param)
    assert server.manager.inputs == []


def test_n_choices_and_batches_share_the_namespace(server):
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 1, "cache_salt": "x"}
    assert server.client.post("/v1/completions", json=body).status_code == 200
    assert len(server.sched.requests) == 4
    assert namespaces_of(server) == {"salt:x"}


def test_api_key_isolation_gives_every_key_its_own_namespace(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# key tenant\nkey-a alice\nkey-b bob\n\nkey-b2 bob\nkey-c\n")
    with served(api_key=["key-0"], api_key_file=str(keys), cache_isolation="api-key") as s:
        check_isolation(s)


def check_isolation(s: Served) -> None:
    client, manager = s.client, s
    body = {"prompt": "abc", "max_tokens": 1}

    def ns(key: str, **extra) -> str:
        headers = {"Authorization": f"Bearer {key}"}
        resp = client.post("/v1/completions", json={**body, **extra}, headers=headers)
        assert resp.status_code == 200, resp.text
        (only,) = namespaces_of(manager)
        return only

    alice, bob, bob2, c, zero = ns("key-a"), ns("key-b"), ns("key-b2"), ns("key-c"), ns("key-0")
    assert alice == "tenant:alice" and bob == bob2 == "tenant:bob"  # one tenant, two keys
    assert len({alice, bob, c, zero}) == 4
    assert "key-c" not in c and "key-0" not in zero  # unnamed tenants: a hash, not the key
    # a salt splits a tenant's namespace further, and can never name another tenant's
    assert ns("key-a", cache_salt="s") == "tenant:alice\x00salt:s" != ns("key-b", cache_salt="s")
    assert ns("key-a", cache_salt="tenant:bob") not in (bob, "tenant:bob")
    assert_error(client.post("/v1/completions", json=body), 401, type_="authentication_error")


def test_without_isolation_keys_do_not_split_the_cache():
    with served(api_key=["k1", "k2"]) as s:
        for key in ("k1", "k2"):
            headers = {"Authorization": f"Bearer {key}"}
            resp = s.client.post(
                "/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=headers
            )
            assert resp.status_code == 200
        assert namespaces_of(s) == {""}


def test_salted_and_tenant_namespaces_never_collide():
    tenant = load_tenants(ServerArgs(api_key="k"))[0]
    for salt in (None, "x", "tenant:" + tenant.name):
        assert not cache_namespace("none", None, salt).startswith("tenant:")
        assert cache_namespace("api-key", tenant, salt).startswith(f"tenant:{tenant.name}")
    assert cache_namespace("none", tenant, "x") == "salt:x"  # keys alone do not isolate


def test_find_tenant_checks_every_key():
    tenants = load_tenants(ServerArgs(api_key=["a", "b"]))
    assert find_tenant(tenants, b"Bearer a") is tenants[0]
    assert find_tenant(tenants, b"Bearer b") is tenants[1]
    assert find_tenant(tenants, b"Bearer ab") is None
    assert find_tenant(tenants, b"") is None


@pytest.mark.parametrize(
    "text, message",
    [("k1 t1 extra\n", "line 1: expected"), ("k1\nk1 other\n", "configured twice")],
)
def test_bad_key_files_are_refused_at_start(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        ServerArgs(api_key_file=str(path)).validate()


def test_isolation_needs_keys():
    with pytest.raises(ValueError, match="needs --api-key"):
        ServerArgs(cache_isolation="api-key").validate()
    with pytest.raises(ValueError, match="api-key-file"):
        ServerArgs(api_key_file="/nonexistent/keys").validate()
