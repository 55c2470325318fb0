"""The scripts' replies and the pool's pub/sub messages, decoded into frozen values.

A script's reply comes as redis-py reads it from a client without ``decode_responses``: Lua
numbers as ``int``, strings as ``bytes``, tables as lists (the shapes are documented beside
each script in ``extproc.pool.shared.scripts``). A reply of another shape raises ``ReplyError``,
which names the script, the item and what was found. The demand tables inside are read as
leniently as ``decode_demand`` reads them (items that do not parse count for nothing): other
replicas wrote them.

Messages on the events channel are read leniently too: one that is not ``freed`` or
``demand`` decodes to None, one with missing fields to empty ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from extproc.pool.shared.scripts import decode_demand

__all__ = [
    "Acquired",
    "DemandChanged",
    "Freed",
    "Renewed",
    "ReplyError",
    "Returned",
    "acquired",
    "event",
    "renewed",
    "returned",
]


class ReplyError(ValueError):
    """A script's reply is not of the shape the script returns."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Acquired:
    """``ACQUIRE``: the first ``granted`` ids asked for are held; the pool's count and limit
    after it; the other replicas' demand."""

    granted: int
    count: int
    limit: int
    others: Mapping[str, Mapping[int, int]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Returned:
    """``RETURN``: how many of the ids were held and are given back; count and limit."""

    given: int
    count: int
    limit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Renewed:
    """``RENEW``: count and limit after it; the leader ('' none); the renewed ids that could
    not be kept (expired with no room left); how many of the claimed ids are held; the live
    replicas; the other replicas' demand."""

    count: int
    limit: int
    leader: str
    lost: tuple[str, ...]
    claimed: int
    live: tuple[str, ...]
    others: Mapping[str, Mapping[int, int]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Freed:
    """``freed <replica> <n> [<for>]``: leases given back, for ``to`` ('' anyone)."""

    replica: str
    to: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DemandChanged:
    """``demand <replica> <table>``: a replica's demand is now ``demand`` (empty: none)."""

    replica: str
    demand: Mapping[int, int]


def _items(script: str, reply: object, names: tuple[str, ...]) -> list[object]:
    if not isinstance(reply, list | tuple):
        raise ReplyError(f"{script} reply: expected a list, got {type(reply).__name__}")
    if len(reply) != len(names):
        raise ReplyError(
            f"{script} reply: expected {len(names)} items ({', '.join(names)}), got {len(reply)}"
        )
    return list(reply)


def _int(script: str, name: str, value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, bytes | str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ReplyError(f"{script} reply: {name} should be an integer, got {value!r}")


def _str(script: str, name: str, value: object) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, str):
        return value
    raise ReplyError(f"{script} reply: {name} should be a string, got {value!r}")


def _strs(script: str, name: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ReplyError(f"{script} reply: {name} should be a list, got {value!r}")
    return tuple(_str(script, f"{name}[{i}]", v) for i, v in enumerate(value))


def _others(script: str, value: object) -> dict[str, dict[int, int]]:
    """``[replica, table, ...]`` -> {replica: demand}, replicas without demand left out."""
    flat = _strs(script, "others' demand", value)
    if len(flat) % 2:
        raise ReplyError(f"{script} reply: others' demand has an odd length {len(flat)}")
    out: dict[str, dict[int, int]] = {}
    for i in range(0, len(flat), 2):
        d = decode_demand(flat[i + 1])
        if d:
            out[flat[i]] = d
    return out


def acquired(reply: object) -> Acquired:
    s = "ACQUIRE"
    granted, count, limit, flat = _items(s, reply, ("granted", "count", "limit", "others"))
    return Acquired(
        granted=_int(s, "granted", granted),
        count=_int(s, "count", count),
        limit=_int(s, "limit", limit),
        others=_others(s, flat),
    )


def returned(reply: object) -> Returned:
    s = "RETURN"
    given, count, limit = _items(s, reply, ("given", "count", "limit"))
    return Returned(
        given=_int(s, "given", given), count=_int(s, "count", count), limit=_int(s, "limit", limit)
    )


def renewed(reply: object) -> Renewed:
    s = "RENEW"
    names = ("count", "limit", "leader", "lost", "claimed", "live", "others")
    count, limit, leader, lost, claimed, live, flat = _items(s, reply, names)
    return Renewed(
        count=_int(s, "count", count),
        limit=_int(s, "limit", limit),
        leader=_str(s, "leader", leader),
        lost=_strs(s, "lost", lost),
        claimed=_int(s, "claimed", claimed),
        live=_strs(s, "live", live),
        others=_others(s, flat),
    )


def event(text: str | bytes) -> Freed | DemandChanged | None:
    """One message of the events channel; None for a kind this replica does not read."""
    if isinstance(text, bytes):
        text = text.decode()
    kind, _, rest = text.partition(" ")
    replica, _, arg = rest.partition(" ")
    if kind == "freed":
        _, _, to = arg.partition(" ")
        return Freed(replica=replica, to=to)
    if kind == "demand":
        return DemandChanged(replica=replica, demand=decode_demand(arg))
    return None
