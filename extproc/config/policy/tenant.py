"""A bucket's ``tenant`` section -> ``TenantPolicy``, its rules checked.

A tenant key comes from where a client cannot forge it: a header listed in
``trusted_headers`` (Envoy strips those from clients; an auth filter in front of ext_proc sets
it), or the Authorization header itself, which a client cannot claim without the credential
(hashed, ``extproc.request.tenant``). The class header that picks a weight is trusted too.
"""

from __future__ import annotations

import math

from extproc._proto.llm_extproc.v1 import policy_pb2
from extproc.config.policy.fields import default, duration_or, header_name, set_or
from extproc.config.policy.model import TenantPolicy
from extproc.config.schema import PolicyError

__all__ = ["tenant_policy"]

# More tenants than this would be memory an operator did not mean to give (the fair order's
# state is ~200 bytes a tenant).
MAX_TRACKED = 1_000_000
# Series a bucket may export with a tenant label (export_top): a bounded opt-in.
MAX_EXPORT_TOP = 20


def tenant_policy(
    bucket: policy_pb2.Bucket, where: str, trusted_headers: tuple[str, ...]
) -> TenantPolicy | None:
    if not bucket.HasField("tenant"):
        return None
    msg, where = bucket.tenant, f"{where}.tenant"
    if bool(msg.header) == msg.authorization:
        raise PolicyError(f"{where}: name exactly one of `header` and `authorization: true`")
    header = _trusted(msg.header, f"{where}.header", trusted_headers) if msg.header else None
    klass = msg.class_header
    class_header = _trusted(klass, f"{where}.class_header", trusted_headers) if klass else None
    for name, weight in msg.weights.items():
        if not (math.isfinite(weight) and weight > 0):
            raise PolicyError(f"{where}.weights.{name}: must be a number above 0 (got {weight})")
    if msg.weights and class_header is None:
        raise PolicyError(f"{where}.weights: needs `class_header` (the header naming the class)")
    max_tracked = set_or(msg, "max_tracked", default(TenantPolicy, "max_tracked"))
    if not 1 <= max_tracked <= MAX_TRACKED:
        raise PolicyError(f"{where}.max_tracked: must be 1 to {MAX_TRACKED} (got {max_tracked})")
    idle_ttl_s = duration_or(msg, "idle_ttl", default(TenantPolicy, "idle_ttl_s"))
    if idle_ttl_s <= 0:
        raise PolicyError(f"{where}.idle_ttl: must be above 0")
    export_top = set_or(msg, "export_top", default(TenantPolicy, "export_top"))
    if export_top > MAX_EXPORT_TOP:
        raise PolicyError(f"{where}.export_top: at most {MAX_EXPORT_TOP} (got {export_top})")
    max_queue = set_or(msg, "max_queue", None)
    max_share = set_or(msg, "max_share", None)
    if max_share is not None and not 0.0 < max_share <= 1.0:
        raise PolicyError(f"{where}.max_share: must be above 0 and at most 1 (got {max_share:g})")
    return TenantPolicy(
        header=header,
        authorization=msg.authorization,
        max_tracked=max_tracked,
        idle_ttl_s=idle_ttl_s,
        max_queue=max_queue,
        max_share=max_share,
        class_header=class_header,
        weights=tuple(sorted(msg.weights.items())),
        export_top=export_top,
    )


def _trusted(name: str, where: str, trusted_headers: tuple[str, ...]) -> str:
    name = header_name(name, where)
    if name not in trusted_headers:
        raise PolicyError(
            f"{where}: {name!r} must be listed in trusted_headers, so that Envoy strips it "
            "from clients (a client could otherwise name any tenant)"
        )
    return name
