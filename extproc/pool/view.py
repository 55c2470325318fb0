"""Gauges and /debug/queues entries, rendered from snapshot dataclasses.

A controller's ``snapshot()`` is a frozen dataclass whose fields say how they are shown. A
field with ``field(metadata=gauge(name, help))`` is the gauge ``llm_extproc_<name>`` with that
help text, and a key of the debug view; a plain field is a debug key only; one with
``field(metadata=HIDDEN)`` is neither; a mapping field with ``metadata=each({key: gauge(...)})``
is one gauge and debug key per key (None where it lacks the key). Adding a gauge is one edit: a
field and its ``gauge(...)``; the metrics collector (``extproc.ops.metrics.POOL_GAUGES``) and
the debug view read the metadata.

How a value renders:

- gauges: an enum by its code (``codes``, which the help text spells out), a bool as 0 or 1,
  a number as it is. A field that is None is left out (``if_none``: that value instead); a
  field with ``when`` is left out while the field it names is 0 or false.
- debug: under its own name (``key``: another one), an enum as its string, a tuple as a list,
  None as null.

Rendering reads the fields at scrape time; nothing here runs per request.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["HIDDEN", "Gauge", "each", "gauge", "gauges_of", "render_debug", "render_gauges"]

_GAUGE = "gauge"
_KEY = "debug_key"  # the field's key in the debug view, when not its name
_HIDDEN = "hidden"
_EACH = "each"  # a mapping field: its keys' metadata

# The metadata of a field shown nowhere (what the views need to compute, not to show).
HIDDEN: Mapping[str, object] = {_HIDDEN: True}


@dataclass(frozen=True, slots=True, kw_only=True)
class Gauge:
    name: str  # the series is llm_extproc_<name>
    help: str
    codes: Mapping[str, int] | None = None  # an enum field: its value -> the gauge's value
    if_none: float | None = None  # the value while the field is None (None: left out)
    when: str | None = None  # another field of the snapshot: left out while it is 0 or false


def gauge(
    name: str,
    help: str,
    *,
    codes: Mapping[str, int] | None = None,
    if_none: float | None = None,
    when: str | None = None,
    key: str | None = None,
) -> dict[str, object]:
    """The metadata of a snapshot field shown as a gauge, and in the debug view as ``key``
    (default: the field's name)."""
    g = Gauge(name=name, help=help, codes=codes, if_none=if_none, when=when)
    return {_GAUGE: g, _KEY: key}


def each(items: Mapping[str, Mapping[str, object]]) -> dict[str, object]:
    """The metadata of a mapping field shown as one entry per key, by ``items[key]``."""
    return {_EACH: items}


def _getter(name: str, key: str | None) -> Callable[[Any], Any]:
    """A field's value, or with ``key`` (``each``) its value there (absent: None)."""
    if key is None:
        return operator.attrgetter(name)
    return lambda snapshot: getattr(snapshot, name).get(key)


_Layout = tuple[tuple[Callable[[Any], Any], Gauge | None, str | None], ...]
_LAYOUTS: dict[type, _Layout] = {}


def _layout(cls: type) -> _Layout:
    """(value getter, gauge, debug key) for each field of a snapshot class (each key of a
    mapping field's ``each``), in field order."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        layout = _LAYOUTS[cls] = tuple(
            (
                _getter(f.name, key),
                meta.get(_GAUGE),
                None if meta.get(_HIDDEN) else meta.get(_KEY) or key or f.name,
            )
            for f in dataclasses.fields(cls)
            for key, meta in f.metadata.get(_EACH, {None: f.metadata}).items()
        )
    return layout


def gauges_of(cls: type) -> list[Gauge]:
    """The gauges of a snapshot class, in field order."""
    return [g for _, g, _ in _layout(cls) if g is not None]


def render_gauges(snapshot: Any, out: dict[str, float]) -> None:
    """Add the snapshot's gauges to ``out`` (name -> value), in field order."""
    for get, g, _ in _layout(type(snapshot)):
        if g is None or (g.when is not None and not getattr(snapshot, g.when)):
            continue
        value = get(snapshot)
        if value is None:
            if g.if_none is not None:
                out[g.name] = g.if_none
        elif g.codes is not None:
            out[g.name] = g.codes[value]
        else:
            out[g.name] = int(value) if isinstance(value, bool) else value


def render_debug(snapshot: Any) -> dict[str, Any]:
    """The snapshot as a JSON-ready dict, in field order."""
    out: dict[str, Any] = {}
    for get, _, key in _layout(type(snapshot)):
        if key is None:
            continue
        value = get(snapshot)
        if isinstance(value, Enum):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out
