"""The scripts' replies and the pool's pub/sub messages, decoded into frozen values.

Everything here comes from Redis, which other replicas (other versions, or anyone who can
write the pool's keys) write too: it is read as untrusted input, each value checked for its
type, its range and its size before it is used, at a cost linear in what is looked at, which
the caps below bound (redis-py has read the whole reply or message already; Redis's own
``proto-max-bulk-len``, 512 MB by default, bounds that).

A script's reply comes as redis-py reads it from a client without ``decode_responses``: Lua
numbers as ``int``, strings as ``bytes``, tables as lists (the shapes are documented beside
each script in ``extproc.pool.shared.scripts``). A reply that no script of ours returns raises
``ReplyError``, which names the script, the item and what was found, and the call fails like
one Redis did not answer (counted, the replica degraded): of another shape; an integer that is
not one, of more than ``MAX_DIGITS`` digits, negative, or more than the call sent (ids granted,
given back, claimed or lost); a replica or lease id that is not UTF-8 or longer than
``MAX_ID_BYTES``; more than ``MAX_REPLICAS`` live replicas or demand entries. The limit is
passed on as the reply says; the ledger clamps it to the replica's bounds.

The demand tables inside a reply are the other replicas' own: one that ``decode_demand``
refuses counts as no demand, and the reply keeps what was refused in ``refused`` (one message
each) for the manager to log and count.

Messages on the events channel: one longer than ``MAX_EVENT_BYTES``, not UTF-8, or a
``demand`` whose table is refused decodes to ``Refused`` (why, for the log); one that is not
``freed`` or ``demand`` to None (a kind this replica does not read); missing fields to empty
ones.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from extproc.pool.shared.scripts import MAX_DIGITS, DemandError, decode_demand, show

__all__ = [
    "MAX_EVENT_BYTES",
    "MAX_ID_BYTES",
    "MAX_REPLICAS",
    "Acquired",
    "DemandChanged",
    "Freed",
    "Refusals",
    "Refused",
    "Renewed",
    "ReplyError",
    "Returned",
    "acquired",
    "event",
    "renewed",
    "returned",
]

# A replica or lease id (a host name, a pid and a few hex digits: some tens of bytes).
MAX_ID_BYTES = 512
# Live replicas of one pool, and entries of the others' demand, in one reply.
MAX_REPLICAS = 1024
# One message of the events channel (``demand <replica> <table>`` at its longest).
MAX_EVENT_BYTES = 8192
# Distinct reasons for refused input logged in one minute, at most (``Refusals``).
_LOGGED_PER_MINUTE = 60


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
    epoch: int = 0  # the pool's epoch (``scripts``: a new one when its state was lost)
    fenced: bool = False  # the new epoch's fence stands: nothing granted
    refused: tuple[str, ...] = ()  # the others' demand tables refused (counted as none)


@dataclass(frozen=True, slots=True, kw_only=True)
class Returned:
    """``RETURN``: how many of the ids were held and are given back; count and limit; the
    epoch and its fence."""

    given: int
    count: int
    limit: int
    epoch: int = 0
    fenced: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Renewed:
    """``RENEW``: count and limit after it; the leader ('' none); the renewed ids that could
    not be kept (expired with no room left); how many of the claimed ids are held; the live
    replicas; the other replicas' demand; the epoch and its fence."""

    count: int
    limit: int
    leader: str
    lost: tuple[str, ...]
    claimed: int
    live: tuple[str, ...]
    others: Mapping[str, Mapping[int, int]]
    epoch: int = 0
    fenced: bool = False
    term: int = 0  # the leader's term (0: no leader)
    policies: int = 0  # other policies (limits) live on this key_prefix
    refused: tuple[str, ...] = ()  # the others' demand tables refused (counted as none)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    """A message of the events channel that this replica does not accept, and why."""

    why: str


def _items(script: str, reply: object, names: tuple[str, ...]) -> list[object]:
    if not isinstance(reply, list | tuple):
        raise ReplyError(f"{script} reply: expected a list, got {type(reply).__name__}")
    if len(reply) != len(names):
        raise ReplyError(
            f"{script} reply: expected {len(names)} items ({', '.join(names)}), got {len(reply)}"
        )
    return list(reply)


def _int(script: str, name: str, value: object, most: int | None = None) -> int:
    """An integer of at least 0 (and at most ``most``): a Lua number, or digits."""
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, bytes | str) and 0 < len(value) <= MAX_DIGITS:
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        digits = text[1:] if text.startswith("-") else text
        if digits.isascii() and digits.isdigit():
            n = int(text)
    if n is None:
        raise ReplyError(f"{script} reply: {name} should be an integer, got {_shown(value)}")
    if n < 0 or (most is not None and n > most):
        bounds = "at least 0" if most is None else f"between 0 and {most}"
        raise ReplyError(f"{script} reply: {name} should be {bounds}, got {n}")
    return n


def _str(script: str, name: str, value: object) -> str:
    if isinstance(value, bytes | str) and len(value) > MAX_ID_BYTES:
        raise ReplyError(
            f"{script} reply: {name} is longer than {MAX_ID_BYTES} bytes: {show(value)}"
        )
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError as e:
            raise ReplyError(
                f"{script} reply: {name} is not UTF-8 ({e.reason} at byte {e.start}): {show(value)}"
            ) from None
    if isinstance(value, str):
        return value
    raise ReplyError(f"{script} reply: {name} should be a string, got {_shown(value)}")


def _strs(script: str, name: str, value: object, most: int) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ReplyError(f"{script} reply: {name} should be a list, got {_shown(value)}")
    if len(value) > most:
        raise ReplyError(f"{script} reply: {name} has {len(value)} items (at most {most})")
    return tuple(_str(script, f"{name}[{i}]", v) for i, v in enumerate(value))


def _shown(value: object) -> str:
    return show(value) if isinstance(value, bytes | str) else repr(value)[:64]


def _others(script: str, value: object) -> tuple[dict[str, dict[int, int]], tuple[str, ...]]:
    """``[replica, table, ...]`` -> ({replica: demand}, the tables refused): replicas without
    demand, or whose table is refused, left out."""
    if not isinstance(value, list | tuple):
        raise ReplyError(f"{script} reply: others' demand should be a list, got {_shown(value)}")
    if len(value) % 2:
        raise ReplyError(f"{script} reply: others' demand has an odd length {len(value)}")
    if len(value) > 2 * MAX_REPLICAS:
        raise ReplyError(
            f"{script} reply: others' demand has {len(value) // 2} entries (at most {MAX_REPLICAS})"
        )
    out: dict[str, dict[int, int]] = {}
    refused: list[str] = []
    for i in range(0, len(value), 2):
        replica = _str(script, f"others' demand[{i}]", value[i])
        table = value[i + 1]
        if not isinstance(table, bytes | str):
            raise ReplyError(
                f"{script} reply: the demand of {replica!r} should be a string, got {_shown(table)}"
            )
        try:
            d = decode_demand(table)
        except DemandError as e:
            refused.append(f"{script} reply: the demand of {replica!r} refused (as none): {e}")
            continue
        if d:
            out[replica] = d
    return out, tuple(refused)


def acquired(reply: object, *, asked: int) -> Acquired:
    """``ACQUIRE``'s reply to a call that sent ``asked`` ids."""
    s = "ACQUIRE"
    names = ("granted", "count", "limit", "others", "epoch", "fenced")
    granted, count, limit, flat, epoch, fenced = _items(s, reply, names)
    others, refused = _others(s, flat)
    return Acquired(
        granted=_int(s, "granted", granted, asked),
        count=_int(s, "count", count),
        limit=_int(s, "limit", limit),
        others=others,
        epoch=_int(s, "epoch", epoch),
        fenced=bool(_int(s, "fenced", fenced, 1)),
        refused=refused,
    )


def returned(reply: object, *, sent: int) -> Returned:
    """``RETURN``'s reply to a call that gave ``sent`` ids back."""
    s = "RETURN"
    given, count, limit, epoch, fenced = _items(
        s, reply, ("given", "count", "limit", "epoch", "fenced")
    )
    return Returned(
        given=_int(s, "given", given, sent),
        count=_int(s, "count", count),
        limit=_int(s, "limit", limit),
        epoch=_int(s, "epoch", epoch),
        fenced=bool(_int(s, "fenced", fenced, 1)),
    )


def renewed(reply: object, *, renewing: int, claiming: int) -> Renewed:
    """``RENEW``'s reply to a call that renewed ``renewing`` and claimed ``claiming`` ids."""
    s = "RENEW"
    names: tuple[str, ...] = ("count", "limit", "leader", "lost", "claimed", "live", "others")
    names += ("epoch", "fenced", "term", "policies")
    items = _items(s, reply, names)
    count, limit, leader, lost, claimed, live, flat, epoch, fenced, term, policies = items
    others, refused = _others(s, flat)
    return Renewed(
        count=_int(s, "count", count),
        limit=_int(s, "limit", limit),
        leader=_str(s, "leader", leader),
        lost=_strs(s, "lost", lost, renewing),
        claimed=_int(s, "claimed", claimed, claiming),
        live=_strs(s, "live", live, MAX_REPLICAS),
        others=others,
        epoch=_int(s, "epoch", epoch),
        fenced=bool(_int(s, "fenced", fenced, 1)),
        term=_int(s, "term", term),
        policies=_int(s, "policies", policies, MAX_REPLICAS),
        refused=refused,
    )


def event(text: str | bytes) -> Freed | DemandChanged | Refused | None:
    """One message of the events channel; None for a kind this replica does not read."""
    if len(text) > MAX_EVENT_BYTES:
        return Refused(why=f"a message of {len(text)} bytes (at most {MAX_EVENT_BYTES})")
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError as e:
            return Refused(why=f"a message not UTF-8 ({e.reason} at byte {e.start}): {show(text)}")
    kind, _, rest = text.partition(" ")
    replica, _, arg = rest.partition(" ")
    if kind == "freed":
        _, _, to = arg.partition(" ")
        return Freed(replica=replica, to=to)
    if kind == "demand":
        try:
            return DemandChanged(replica=replica, demand=decode_demand(arg))
        except DemandError as e:
            return Refused(why=f"a demand message from {show(replica)} refused: {e}")
    return None


class Refusals:
    """Input refused, as the lease manager reports it: every refusal counted
    (``on_error(what)``), each reason logged once, at most ``_LOGGED_PER_MINUTE`` reasons a
    minute (a bad entry that every reply carries logs once; a flood of distinct bad messages
    costs the log a line or so a second), the rest counted only."""

    def __init__(
        self,
        log: logging.Logger,
        on_error: Callable[[str], None] | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._on_error = on_error
        self._clock = clock
        self._logged: dict[str, None] = {}  # the reasons logged this minute
        self._minute = -math.inf  # when this minute started

    def __call__(self, what: str, reasons: tuple[str, ...]) -> None:
        for why in reasons:
            if self._on_error is not None:
                self._on_error(what)
            now = self._clock()
            if now - self._minute >= 60.0:
                self._minute, self._logged = now, {}
            if why in self._logged or len(self._logged) > _LOGGED_PER_MINUTE:
                continue
            self._logged[why] = None
            if len(self._logged) > _LOGGED_PER_MINUTE:
                self._log.error("shared pool: more input refused this minute: counted only")
            else:
                self._log.error("shared pool: refused from Redis: %s", why)
