"""The tenant-header watch, on the overload loop's tick.

Each bucket whose tenant is a trusted header's value (``tenant.header``) is looked at
(``extproc.pool.core.tenants.watch_header``, on the totals the gate counts as requests join):
when a window of ``HEADER_WINDOW_S`` saw at least ``HEADER_MIN_REQUESTS`` requests and none had
the header, the bucket's requests are all one anonymous tenant;
``llm_extproc_tenant_header_missing{bucket}`` is 1 and one line at WARNING says so, until a
request with the header comes (one line at INFO). A policy (re)load gives each such bucket its
series at 0, drops those of buckets that have no tenant header any more, and watches a bucket
whose header changed afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from extproc.config.policy import Policy
from extproc.pool.core.tenants import HeaderWatch, TenantSeen, watch_header

__all__ = ["Levels", "TenantHeaders"]

log = logging.getLogger("extproc.control")


class _Level(Protocol):
    def set(self, value: float) -> None: ...


class Levels(Protocol):  # a family of gauges by their label
    def labels(self, *values: str) -> _Level: ...
    def remove(self, *values: str) -> None: ...


class TenantHeaders:
    """The buckets whose tenant is a header, watched; ``gauge``: the missing series by bucket,
    ``seen``: the gate's totals (``Gate.tenants_seen``)."""

    def __init__(self, gauge: Levels, seen: Callable[[], Mapping[str, TenantSeen]]) -> None:
        self._gauge = gauge
        self._seen = seen
        # Bucket -> (its tenant header, the watch; None until the first look).
        self._headers: dict[str, tuple[str, HeaderWatch | None]] = {}

    def follow(self, policy: Policy) -> None:
        """The buckets of ``policy`` whose tenant is a header: a series at 0 for each new one;
        one gone, or whose header changed, is forgotten (and watched afresh)."""
        headers = {
            b.name: b.tenant.header
            for b in policy.buckets
            if b.tenant is not None and b.tenant.header is not None
        }
        for name, (header, _) in list(self._headers.items()):
            if headers.get(name) != header:
                del self._headers[name]
                self._gauge.remove(name)
        for name, header in headers.items():
            if name not in self._headers:
                self._headers[name] = (header, None)
                self._gauge.labels(name).set(0)

    def look(self, now: float) -> None:
        """One look at each bucket; a change of its verdict sets its gauge and is one log
        line."""
        if not self._headers:
            return
        seen = self._seen()
        for name, (header, before) in self._headers.items():
            totals = seen.get(name)
            if totals is None:
                continue
            after = watch_header(before, totals, now)
            self._headers[name] = (header, after)
            if before is None or after.missing == before.missing:
                continue
            self._gauge.labels(name).set(int(after.missing))
            if after.missing:
                log.warning(
                    "bucket %s: its %d requests of the last %.0f s all came without the tenant "
                    "header %s, so they are one anonymous tenant and fairness between tenants "
                    "is off; the filter that sets it runs before the strip of trusted_headers, "
                    "or it is not set",
                    name,
                    after.seen.joined - before.seen.joined,
                    now - before.since,
                    header,
                )
            else:
                log.info("bucket %s: requests carry the tenant header %s again", name, header)

    def debug(self) -> dict[str, Any]:
        """The buckets for /debug/queues (``tenant_headers``)."""
        return {
            name: {"header": header, "missing": watch is not None and watch.missing}
            for name, (header, watch) in self._headers.items()
        }
