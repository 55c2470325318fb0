"""Who a request is for: its tenant key and weight, from the bucket's ``tenant`` policy.

The key is a trusted header's value (Envoy strips the header from clients; see
``extproc.config.policy.tenant``), or the Authorization header's as a keyed hash: HMAC-SHA256
under a key this process draws at start (``LLM_EXTPROC_TENANT_KEY`` sets it instead, so that
replicas and restarts agree), the first 16 hex digits kept. The credential itself is never
kept, logged or exported; a header value longer than ``MAX_KEY_CHARS`` is hashed the same way,
so no tenant key costs more than a few dozen bytes whatever a peer sends. A request without
the header has no key: it belongs to the bucket's one anonymous tenant, which the fair order
treats as any other and the per-tenant bounds leave alone.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Final, NamedTuple

from extproc.config.policy import TenantPolicy

__all__ = ["NO_TENANT", "Tenant", "tenant_of"]

MAX_KEY_CHARS: Final = 64
_KEY: Final = os.environ.get("LLM_EXTPROC_TENANT_KEY", "").encode() or os.urandom(32)


class Tenant(NamedTuple):
    key: str | None
    weight: float


NO_TENANT: Final = Tenant(None, 1.0)


def tenant_of(policy: TenantPolicy | None, headers: Mapping[str, str]) -> Tenant:
    if policy is None:
        return NO_TENANT
    if policy.header is not None:
        key = headers.get(policy.header)
        if key is not None and len(key) > MAX_KEY_CHARS:
            key = _hashed(key)
    else:
        auth = headers.get("authorization")
        key = None if auth is None else _hashed(auth)
    weight = 1.0
    if policy.class_header is not None and policy.weights:
        klass = headers.get(policy.class_header)
        for name, w in policy.weights:
            if name == klass:
                weight = w
                break
    return Tenant(key, weight)


def _hashed(value: str) -> str:
    return (
        "h:"
        + hmac.new(_KEY, value.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()[:16]
    )
