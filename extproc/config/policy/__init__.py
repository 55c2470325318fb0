"""The admission policy: load, validate, resolve, print.

The schema is defined once, as proto3 messages in ``protos/llm_extproc/v1/policy.proto``. A policy
file is YAML; ``extproc.config.schema`` reads it into the ``Policy`` message, checking every key,
and every error names the file, the key path and the reason (``policy.yaml:
buckets[1].queue_timeout: bad duration '5x' ...``). Route metadata from Envoy is read into the
``RouteOverride`` message the same way.

Three steps, data flowing one way:

- ``model``: the resolved policy, frozen dataclasses with each default written once, in their
  fields or a latency objective's row (``extproc.objectives``; the embedded
  ``default_policy.yaml`` states only its pool, buckets and trusted headers). The request path
  reads only the resolved ``Policy``; it never touches protobuf.
- ``resolve``: the message -> the model, one function per section (the larger sections in
  modules of their own: ``buckets``, ``tenant``, ``pool``), every default filled in from the
  model and every cross-field rule checked (bucket names unique, a catch-all bucket last, ...).
- ``dump``: the model -> the file's shape again (``Policy.to_dict``, what ``llm-extproc
  check`` prints), derived from the dataclass fields and a small map of the keys that differ.

Everything public is importable from here.
"""

from extproc.config.policy.model import (
    RETRY_COUNT_HEADER,
    AdaptivePolicy,
    BackendPolicy,
    BucketPolicy,
    ClientDeadlinePolicy,
    Limits,
    MatchRule,
    Mode,
    OnExcess,
    Order,
    OverloadPolicy,
    Policy,
    PoolPolicy,
    RetryAfterPolicy,
    RouteOverride,
    SharedPolicy,
    TenantPolicy,
    TokenPolicy,
    is_retry,
)
from extproc.config.policy.resolve import (
    load_policy,
    policy_from_mapping,
    policy_from_yaml,
    route_override_from_mapping,
)
from extproc.config.schema import PolicyError, parse_duration

__all__ = [
    "RETRY_COUNT_HEADER",
    "AdaptivePolicy",
    "BackendPolicy",
    "BucketPolicy",
    "ClientDeadlinePolicy",
    "Limits",
    "MatchRule",
    "Mode",
    "OnExcess",
    "Order",
    "OverloadPolicy",
    "Policy",
    "PolicyError",
    "PoolPolicy",
    "RetryAfterPolicy",
    "RouteOverride",
    "SharedPolicy",
    "TenantPolicy",
    "TokenPolicy",
    "is_retry",
    "load_policy",
    "parse_duration",
    "policy_from_mapping",
    "policy_from_yaml",
    "route_override_from_mapping",
]
