"""The policy schema walker: YAML data -> a proto message, every key checked.

The schema is defined once, as proto3 messages in ``protos/llm_extproc/v1/policy.proto``. This
walker fills a message from what YAML parses into, driven by the message descriptors, so every
key is checked against the schema and every error names the key path and the reason
(``buckets[1].queue_timeout: bad duration '5x' ...``). It accepts what operators write
(durations as ``250ms``/``5s``/``2m``, enum values in lower case) and nothing the schema does
not know. ``extproc.config.policy`` uses it for policy files and for route metadata.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from google.protobuf import descriptor as _descriptor
from google.protobuf import duration_pb2
from google.protobuf.message import Message

__all__ = ["PolicyError", "fill", "parse_duration"]


class PolicyError(ValueError):
    """A policy that cannot be used. The message names the source, the key path and why."""


# --- durations ------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float:
    """``250ms``, ``5s``, ``1.5s``, ``2m``, ``1h`` or a plain number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 250ms, 5s or 2m, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        m = _DURATION.match(value)
        if m is None:
            raise ValueError(f"bad duration {value!r}: expected a number with ms, s, m or h")
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    else:
        raise ValueError(f"expected a duration like 250ms, 5s or 2m, got {type(value).__name__}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"bad duration {value!r}: must be finite and not negative")
    if seconds > 10 * 365 * 86400:
        raise ValueError(f"bad duration {value!r}: longer than ten years")
    return seconds


# --- the descriptor-driven walker -----------------------------------------------------------

_FD = _descriptor.FieldDescriptor
_DURATION_TYPE = "google.protobuf.Duration"
_INT_RANGES = {
    _FD.TYPE_UINT32: (0, 2**32 - 1),
    _FD.TYPE_UINT64: (0, 2**64 - 1),
    _FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    _FD.TYPE_INT64: (-(2**63), 2**63 - 1),
}


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _scalar(fd: Any, value: object, path: str) -> object:
    """Check one YAML scalar against a proto scalar field and convert it."""
    if fd.type in _INT_RANGES:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise PolicyError(f"{path}: expected an integer, got {_type_name(value)} {value!r}")
        lo, hi = _INT_RANGES[fd.type]
        if not lo <= value <= hi:
            raise PolicyError(f"{path}: {value} is out of range [{lo}, {hi}]")
        return value
    if fd.type in (_FD.TYPE_DOUBLE, _FD.TYPE_FLOAT):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PolicyError(f"{path}: expected a number, got {_type_name(value)} {value!r}")
        if not math.isfinite(value):
            raise PolicyError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if fd.type == _FD.TYPE_STRING:
        if not isinstance(value, str):
            raise PolicyError(f"{path}: expected a string, got {_type_name(value)} {value!r}")
        return value
    if fd.type == _FD.TYPE_BOOL:
        if not isinstance(value, bool):
            raise PolicyError(f"{path}: expected true or false, got {value!r}")
        return value
    if fd.type == _FD.TYPE_ENUM:
        names = [v.name.lower() for v in fd.enum_type.values if v.number != 0]
        if not isinstance(value, str) or value.lower() not in names:
            raise PolicyError(f"{path}: expected one of {', '.join(names)}, got {value!r}")
        return fd.enum_type.values_by_name[value.upper()].number
    raise PolicyError(f"{path}: unsupported field type {fd.type}")  # pragma: no cover


def fill(message: Message, data: object, path: str) -> None:
    """Fill ``message`` from a YAML mapping, checking every key against the descriptor."""
    desc = message.DESCRIPTOR
    if desc.full_name == _DURATION_TYPE:
        raise AssertionError("durations are handled by the caller")  # pragma: no cover
    if not isinstance(data, Mapping):
        raise PolicyError(f"{path or '<top>'}: expected a mapping, got {_type_name(data)}")
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        fd = desc.fields_by_name.get(key) if isinstance(key, str) else None
        if fd is None:
            known = ", ".join(f.name for f in desc.fields)
            raise PolicyError(f"{where}: unknown key (known keys: {known})")
        if value is None:
            continue  # YAML null: leave the field unset, so its default applies
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            _fill_map(getattr(message, fd.name), fd.message_type, value, where)
        elif fd.is_repeated:
            if not isinstance(value, list):
                raise PolicyError(f"{where}: expected a list, got {_type_name(value)}")
            target = getattr(message, fd.name)
            for i, item in enumerate(value):
                if fd.message_type is not None:
                    fill(target.add(), item, f"{where}[{i}]")
                else:
                    target.append(_scalar(fd, item, f"{where}[{i}]"))
        elif fd.message_type is not None and fd.message_type.full_name == _DURATION_TYPE:
            try:
                seconds = parse_duration(value)
            except ValueError as e:
                raise PolicyError(f"{where}: {e}") from None
            d = duration_pb2.Duration()
            d.FromNanoseconds(round(seconds * 1e9))
            getattr(message, fd.name).CopyFrom(d)
        elif fd.message_type is not None:
            sub = getattr(message, fd.name)
            sub.SetInParent()
            fill(sub, value, where)
        else:
            setattr(message, fd.name, _scalar(fd, value, where))


def _fill_map(target: Any, entry: Any, data: object, path: str) -> None:
    if not isinstance(data, Mapping):
        raise PolicyError(f"{path}: expected a mapping, got {_type_name(data)}")
    key_fd, value_fd = entry.fields_by_name["key"], entry.fields_by_name["value"]
    for key, value in data.items():
        k = _scalar(key_fd, key, f"{path} key")
        target[k] = _scalar(value_fd, value, f"{path}.{key}")
