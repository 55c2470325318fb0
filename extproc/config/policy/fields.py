"""Reading one field of a policy message: its default from the model, a proto3 ``optional``
or a duration when set, a header name checked and lower-cased; the error for two values of one
section out of order (``resolve`` and ``tenant``)."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from typing import Any, TypeVar

from google.protobuf import duration_pb2

from extproc.config.schema import PolicyError

__all__ = ["conflict", "default", "duration_or", "header_name", "set_or"]

_T = TypeVar("_T")

_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+$")


def default(cls: type[Any], name: str) -> Any:
    """The default the model writes for ``cls.name``."""
    (f,) = [f for f in fields(cls) if f.name == name]
    if f.default is MISSING:
        raise TypeError(f"{cls.__name__}.{name} has no plain default")
    return f.default


def set_or(msg: Any, name: str, default: Any) -> Any:
    """A proto3 ``optional`` field's value when the file set it, else the default."""
    return getattr(msg, name) if msg.HasField(name) else default


def duration_or(msg: Any, name: str, default: _T) -> float | _T:
    """A duration field's seconds when the file set it, else the default."""
    if not msg.HasField(name):
        return default
    d: duration_pb2.Duration = getattr(msg, name)
    return float(d.ToNanoseconds()) / 1e9


def header_name(name: str, where: str) -> str:
    """A header name, lower-cased; ``where`` is its key, named when it is not valid."""
    if not _HEADER_NAME.match(name.lower()):
        raise PolicyError(f"{where}: {name!r} is not a valid header name")
    return name.lower()


def conflict(
    msg: Any, where: str, key: str, value: str, relation: str, other: str, other_value: str
) -> PolicyError:
    """``where.key`` (``value``, as the file writes it) is ``relation`` ("above" or "below")
    ``where.other`` (``other_value``), which it must not be (``where`` empty: top-level keys).
    The error names both values, says when ``other`` is the model's default (the file did not
    set it: a default that does not follow ``key``, ``resolve``'s rule), and how to fix it."""
    if relation not in ("above", "below"):
        raise ValueError(f"relation must be 'above' or 'below', not {relation!r}")
    other_bound, own_bound = (
        ("at least", "at most") if relation == "above" else ("at most", "at least")
    )
    default = "" if msg.HasField(other) else ", the default"
    section = f"{where}." if where else ""  # route metadata has no section
    return PolicyError(
        f"{section}{key}: {value} is {relation} {section}{other} ({other_value}{default}); "
        f"set {other} to {other_bound} {value}, or {key} to {own_bound} {other_value}"
    )
