"""Who may call the server, and which radix tree namespace each request's KV is shared in.

A namespace is a string the scheduler's radix tree keys a subtree of the root by (see
scheduler/radix_cache.py): requests share cached KV only with requests of the same namespace.
The HTTP layer derives it here, from two sources:

- the caller's cache salt (``cache_salt``, vLLM's name, or SGLang's ``extra_key``): requests with
  the same salt share a namespace; no salt is the public namespace (``""``);
- with ``--cache-isolation api-key``, the tenant of the API key the request came with: every
  tenant gets its own namespace whatever salt it sends (a salt then only splits the tenant's
  namespace further). A tenant is one key, or several keys that ``--api-key-file`` gives the same
  tenant name.

The two kinds are prefixed differently (``salt:`` / ``tenant:``), so no salt a caller can send
names a tenant's namespace.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from radix_runtime.config import ServerArgs

PUBLIC_NAMESPACE = ""


@dataclass(frozen=True)
class Tenant:
    name: str  # names its namespace; never the key itself
    bearer: bytes  # the whole expected header value, b"Bearer <key>"


def load_tenants(args: ServerArgs) -> list[Tenant]:
    """The configured API keys: every ``--api-key`` (its tenant named by a hash of the key) and
    every line ``KEY [TENANT]`` of ``--api-key-file`` (blank lines and ``#`` comments skipped).
    Raises ValueError for a malformed file or a key given twice."""
    entries: list[tuple[str, str | None]] = [(key, None) for key in args.api_keys()]
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                parts = line.split()
                if len(parts) > 2:
                    raise ValueError(
                        f"--api-key-file line {number}: expected 'KEY [TENANT]', got "
                        f"{len(parts)} fields"
                    )
                entries.append((parts[0], parts[1] if len(parts) == 2 else None))
    tenants, seen = [], set()
    for key, name in entries:
        if key in seen:
            raise ValueError("an API key is configured twice")
        seen.add(key)
        # NOTE: an unnamed key's tenant is a hash of the key: stable, and never the key itself
        name = name or "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
        tenants.append(Tenant(name, f"Bearer {key}".encode()))
    return tenants


def find_tenant(tenants: list[Tenant], authorization: bytes) -> Tenant | None:
    """The tenant whose key the Authorization header carries, or None. Every key is compared,
    each in constant time, so the time taken says nothing about which key (or how much of one)
    matched."""
    found = None
    for tenant in tenants:
        if hmac.compare_digest(authorization, tenant.bearer) and found is None:
            found = tenant
    return found


def cache_namespace(isolation: str, tenant: Tenant | None, salt: str | None) -> str:
    """The radix tree namespace of a request with this tenant (None without keys) and salt."""
    salted = "" if salt is None else "salt:" + salt
    if isolation == "api-key" and tenant is not None:
        return f"tenant:{tenant.name}" + ("\x00" + salted if salted else "")
    return salted
