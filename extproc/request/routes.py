"""Route metadata from Envoy -> a validated ``RouteOverride``, parsed once per distinct route.

Envoy sends the route's metadata on the request_headers message when the filter asks for the
``xds.route_metadata`` attribute (``extproc.contract``): a string holding the text format of
``envoy.config.core.v3.Metadata``. The sidecar reads its ``llm_extproc`` namespace and validates
it against the ``RouteOverride`` schema and the policy it refines.

Every request of a route carries the same string, so the result is cached by that string
(``RouteCache``, at most 256 entries; full, it starts over). Metadata that fails validation is
logged once, when first seen, and cached as invalid: the route then falls back to the policy
file. A route whose override limits its bucket (``max_concurrency``/``max_queue``) gets a
``Share`` (``extproc.pool.shares``) with a key unique to that route and policy; the cache
tells its owner when it forgets its routes (``on_clear``), so their shares can go.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from google.protobuf import json_format, struct_pb2, text_format

from extproc.config.policy import Policy, PolicyError, RouteOverride, route_override_from_mapping
from extproc.contract import METADATA_NAMESPACE, ROUTE_ATTRIBUTE, ROUTE_ATTRIBUTES_KEY
from extproc.pool.shares import Share

__all__ = ["NO_ROUTE", "Route", "RouteCache"]

log = logging.getLogger("extproc.routes")

_CACHE_SIZE = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """What a request's route says: its override (None: the file's policy applies), its share
    of its bucket (None: no limit of its own), and whether its metadata was refused."""

    override: RouteOverride | None = None
    share: Share | None = None
    invalid: bool = False


NO_ROUTE = Route()


class RouteCache:
    """Validated route overrides, keyed by the metadata string Envoy sends."""

    def __init__(self, on_clear: Callable[[], None] = lambda: None) -> None:
        self._routes: dict[str, Route] = {}
        self._on_clear = on_clear
        self._share_ids = itertools.count(1)

    def clear(self) -> None:
        """Forget every route (a new policy: overrides are validated against it)."""
        self._routes.clear()
        self._on_clear()

    def lookup(self, attributes: Mapping[str, struct_pb2.Struct], policy: Policy) -> Route:
        """The route of a request_headers message, from its ``attributes`` map."""
        if ROUTE_ATTRIBUTES_KEY not in attributes:
            return NO_ROUTE
        value = attributes[ROUTE_ATTRIBUTES_KEY].fields.get(ROUTE_ATTRIBUTE)
        raw = value.string_value if value is not None else ""
        if not raw:
            return NO_ROUTE
        cached = self._routes.get(raw)
        if cached is not None:
            return cached
        if len(self._routes) >= _CACHE_SIZE:
            self.clear()
        route = self._routes[raw] = self._compile(raw, policy)
        return route

    def _compile(self, raw: str, policy: Policy) -> Route:
        override = _override(raw, policy)
        if override is None:
            return NO_ROUTE
        if isinstance(override, _Invalid):
            return Route(invalid=True)
        share = None
        if override.bucket is not None and (
            override.max_concurrency is not None or override.max_queue is not None
        ):
            b = policy.bucket(override.bucket)
            capacity = override.max_concurrency or b.max_concurrency
            if capacity < 1:
                # A bucket of a pool has no slots of its own (max_concurrency 0: none), so a
                # share needs the route's own max_concurrency; without one there is nothing
                # for its max_queue to queue for. Refused like any bad metadata: never a 500.
                log.warning(
                    "route metadata %s.max_queue refused: bucket %r has no max_concurrency of "
                    "its own, so the route needs one; the policy file applies to this route",
                    METADATA_NAMESPACE,
                    b.name,
                )
                return Route(invalid=True)
            share = Share(
                key=f"{b.name}/route-{next(self._share_ids)}",
                capacity=capacity,
                max_queue=b.max_queue if override.max_queue is None else override.max_queue,
            )
        return Route(override=override, share=share)


class _Invalid:
    """Route metadata that failed validation."""


def _override(raw: str, policy: Policy) -> RouteOverride | _Invalid | None:
    try:
        md = text_format.Parse(raw, base_pb2.Metadata())
    except text_format.ParseError as e:
        log.warning("route metadata is not text-format Metadata: %s", e)
        return _Invalid()
    if METADATA_NAMESPACE not in md.filter_metadata:
        return None
    data = json_format.MessageToDict(md.filter_metadata[METADATA_NAMESPACE])
    try:
        override = route_override_from_mapping(data, policy)
    except PolicyError as e:
        log.warning(
            "route metadata %s.%s refused; the policy file applies to this route",
            METADATA_NAMESPACE,
            e,
            extra={"fields": {"route_metadata": data}},
        )
        return _Invalid()
    return override
