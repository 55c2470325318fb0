"""A bucket's ``tenant``: what resolves, every rule with its message, the round trip through
``check``, and the key a request gets (the credential never kept)."""

from __future__ import annotations

import re

import pytest
import yaml

from extproc.config.policy import Order, PolicyError, TenantPolicy, policy_from_yaml
from extproc.request.tenant import MAX_KEY_CHARS, NO_TENANT, Tenant, tenant_of

TENANT = """
trusted_headers: [x-tenant-id, x-tenant-class]
pool: {max_concurrency: 8}
buckets:
  - name: chat
    queue_timeout: 2s
    max_queue: 10
    order: fair
    tenant: %s
"""


def policy(tenant: str) -> TenantPolicy | None:
    return policy_from_yaml(TENANT % tenant).buckets[0].tenant


def test_a_tenant_resolves_with_its_defaults_and_round_trips() -> None:
    t = policy("{header: X-Tenant-Id, class_header: x-tenant-class, weights: {gold: 2}}")
    assert t == TenantPolicy(
        header="x-tenant-id", class_header="x-tenant-class", weights=(("gold", 2.0),)
    )
    assert (t.max_tracked, t.idle_ttl_s, t.max_queue, t.max_share) == (10_000, 60.0, None, None)
    p = policy_from_yaml(TENANT % "{authorization: true, max_queue: 4, max_share: 0.25}")
    assert p.buckets[0].order is Order.FAIR
    assert policy_from_yaml(yaml.safe_dump(p.to_dict())) == p


@pytest.mark.parametrize(
    ("tenant", "error"),
    [
        ("{}", "name exactly one of `header` and `authorization: true`"),
        ("{header: x-tenant-id, authorization: true}", "name exactly one of"),
        ("{header: x-user}", "tenant.header: 'x-user' must be listed in trusted_headers"),
        ("{header: x-tenant-id, weights: {gold: 2}}", "weights: needs `class_header`"),
        (
            "{header: x-tenant-id, class_header: x-tenant-class, weights: {gold: 0}}",
            "weights.gold: must be a number above 0",
        ),
        ("{header: x-tenant-id, max_tracked: 0}", "max_tracked: must be 1 to 1000000"),
        ("{header: x-tenant-id, idle_ttl: 0s}", "idle_ttl: must be above 0"),
        ("{header: x-tenant-id, max_share: 1.5}", "max_share: must be above 0 and at most 1"),
    ],
)
def test_every_rule_names_its_key(tenant: str, error: str) -> None:
    with pytest.raises(PolicyError, match=re.escape("buckets[0].tenant")) as info:
        policy(tenant)
    assert error in str(info.value)


def test_fair_needs_a_tenant_and_a_tenant_needs_a_pool() -> None:
    with pytest.raises(PolicyError, match="order: fair needs a `tenant`"):
        policy_from_yaml((TENANT % "{}").replace("    tenant: {}\n", ""))
    with pytest.raises(PolicyError, match=re.escape("buckets[0].tenant: needs a `pool`")):
        policy_from_yaml(
            "buckets: [{name: a, max_concurrency: 1, queue_timeout: 1s, max_queue: 1,"
            " tenant: {authorization: true}}]"
        )


def test_a_request_gets_its_tenant_and_weight() -> None:
    t = policy("{header: x-tenant-id, class_header: x-tenant-class, weights: {gold: 3}}")
    assert tenant_of(t, {"x-tenant-id": "acme", "x-tenant-class": "gold"}) == Tenant("acme", 3.0)
    assert tenant_of(t, {"x-tenant-id": "acme", "x-tenant-class": "other"}) == Tenant("acme", 1.0)
    assert tenant_of(t, {}) == Tenant(None, 1.0) == NO_TENANT
    assert tenant_of(None, {"x-tenant-id": "acme"}) == NO_TENANT
    long = tenant_of(t, {"x-tenant-id": "x" * (MAX_KEY_CHARS + 1)}).key
    assert long is not None and len(long) == 18 and long.startswith("h:")


def test_the_authorization_header_is_hashed_never_kept() -> None:
    t = policy("{authorization: true}")
    a = tenant_of(t, {"authorization": "Bearer sk-secret-1"})
    b = tenant_of(t, {"authorization": "Bearer sk-secret-2"})
    assert a.key is not None and "secret" not in a.key and a.key != b.key
    assert tenant_of(t, {"authorization": "Bearer sk-secret-1"}) == a  # stable in a process
