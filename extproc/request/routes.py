"""Route metadata from Envoy -> a validated ``RouteOverride``, parsed once per distinct route.

Envoy sends the route's metadata on the request_headers message when the filter asks for the
``xds.route_metadata`` attribute (``extproc.contract``): a string holding the text format of
``envoy.config.core.v3.Metadata``. The sidecar reads its ``llm_extproc`` namespace and validates
it against the ``RouteOverride`` schema and the policy it refines.

Every request of a route carries the same string, so the result is cached by that string
(``RouteCache``, at most 256 entries; full, it starts over). Metadata that fails validation is
logged once, when first seen, and cached as invalid: the route then falls back to the policy
file. This module only reads: what a route's override changes elsewhere (its bucket's limits)
is for the caller to apply, once, when ``Route.first_seen`` says the route is new.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from google.protobuf import json_format, struct_pb2, text_format

from extproc.config.policy import Policy, PolicyError, RouteOverride, route_override_from_mapping
from extproc.contract import METADATA_NAMESPACE, ROUTE_ATTRIBUTE, ROUTE_ATTRIBUTES_KEY

__all__ = ["NO_ROUTE", "Route", "RouteCache"]

log = logging.getLogger("extproc.routes")

_CACHE_SIZE = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class Route:
    """What a request's route says: its override (None: the file's policy applies), whether
    its metadata was refused, and whether this is the first request seen with it."""

    override: RouteOverride | None = None
    invalid: bool = False
    first_seen: bool = False


NO_ROUTE = Route()


class RouteCache:
    """Validated route overrides, keyed by the metadata string Envoy sends."""

    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}

    def clear(self) -> None:
        """Forget every route (a new policy: overrides are validated against it)."""
        self._routes.clear()

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
            self._routes.clear()
        route = _compile(raw, policy)
        self._routes[raw] = Route(override=route.override, invalid=route.invalid)
        return route


def _compile(raw: str, policy: Policy) -> Route:
    try:
        md = text_format.Parse(raw, base_pb2.Metadata())
    except text_format.ParseError as e:
        log.warning("route metadata is not text-format Metadata: %s", e)
        return Route(invalid=True, first_seen=True)
    if METADATA_NAMESPACE not in md.filter_metadata:
        return Route(first_seen=True)
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
        return Route(invalid=True, first_seen=True)
    return Route(override=override, first_seen=True)
