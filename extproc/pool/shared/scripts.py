"""The shared pool's state in Redis and the three Lua scripts that change it.

Keys (``{prefix}`` is ``pool.shared.key_prefix`` in a hash tag, so a Redis Cluster keeps them
in one slot, which a script needs):

- ``{prefix}:leases``: sorted set, lease id -> expiry (ms, server clock). One member per slot
  held anywhere; a lease id is ``<replica>:<n>``. The pool's count is its cardinality once
  the expired members are dropped.
- ``{prefix}:replicas``: sorted set, replica id -> expiry (ms). A replica is live while its
  entry has not expired; every script it runs refreshes it.
- ``{prefix}:demand``: hash, replica id -> ``band:count,band:count`` (bands are bucket
  priorities, lower = more urgent): the replica's waiters that a lease would let in and that
  hold none. Removed with the replica's entry when it expires.
- ``{prefix}:leader``: ``<term>:<replica>``, the replica that computes the adaptive limit
  (``SET NX PX lease``) and its term (the server time in ms when it won, and always after the
  last term: a leader that steps down leaves ``<term>:`` for a lease, so a term that starts in
  the same millisecond is still a new one). A limit is
  published with the term it was computed in, and only in the term in force: a replica that
  wins the leadership back does not publish what it computed in an earlier term, nor a
  stale leader over a new one.
- ``{prefix}:limit``: the limit the leader publishes (``PX 3 x lease``); absent (a static pool,
  or no leader for that long) or not a number, each caller's own limit applies (ARGV); each
  caller clamps it to its own bounds (ARGV: a static pool's are its own limit, so it ignores
  the key).
- ``{prefix}:handoff``: hash, replica id -> ``n:expiry``: slots given back *for* that replica,
  reserved for its next ``ACQUIRE`` until the (short) expiry, then free for anyone. They count
  as taken. Without it, a freed slot would go to whichever replica's ``ACQUIRE`` arrives first,
  which pub/sub delivery order decides (the same replica every time).
- ``{prefix}:epoch``: ``<epoch>:<seen>:<lives>``: the pool's epoch (the server time in ms
  when this state began), when a script last ran, and until when the leases it left live.
  A script that finds it missing (Redis restarted empty, FLUSHALL, the key evicted), finds no
  script ran for a lease (every replica cut off, or a restore from an old snapshot), or finds
  the leases set gone while leases should live (the set evicted) starts a new epoch: the
  count in Redis no longer covers what the replicas run.
- ``{prefix}:fence``: hash, replica id -> ``1`` (re-registered in this epoch) or ``0``
  (expected), and ``#`` until a ``RENEW`` of a replica that knows who ran said so; made by a
  new epoch with ``PX lease``. While it exists, ``ACQUIRE`` grants nothing: the replicas
  re-register what they run (every ``RENEW`` carries every lease held and claims one per
  running request), and each ``RENEW`` names the replicas it last saw live; the fence ends
  when every replica named (and every one that called meanwhile) has renewed, or after the
  lease, and its ``RENEW`` publishes ``freed``. A *fresh* replica (one that has never seen
  the pool outside a fence: it started after the loss, or during the last fence) knows
  nobody who ran before the loss, so its ``RENEW`` re-registers it but leaves ``#``: when
  only fresh replicas call (a newcomer first after a FLUSHALL, or a whole new pool, which
  looks the same) the fence lasts its lease.
- ``{prefix}:policies``: hash, ``least:most`` (the bounds of a caller's limit: a static
  pool's limit twice, an adaptive pool's ``min:max``) -> expiry (ms): the policies whose
  replicas renewed within the lease. ``RENEW`` reports how many others than the caller's
  are live: two deployments with different limits on one ``key_prefix`` make one pool.
- channel ``{prefix}:events``: ``freed <replica> <n> [<for>]`` (leases given back, for one
  replica or anyone) and ``demand <replica> <table>`` (a replica's demand changed).

Every script reads the time from the server (``TIME``), never from the replicas, and starts by
dropping expired leases and dead replicas, so a replica that died stops counting within its
lease whoever runs the next script. Scripts run atomically: between the count and the ``ZADD``
nobody else acquires, which is what makes the limit exact.

Who gets free slots (``ACQUIRE``): first the slots handed to the caller; then the bands of
the caller's ask and of everyone else's demand, most urgent first. A band of the others alone
reserves what it waits for; the caller's own band takes what is free, split with the others'
waiters of the same band in proportion to the waiters (rounded up for the caller, so a single
free slot is never left to nobody). So the more urgent band on replica A beats a less urgent
band on replica B even though B asked first. Who a given-back slot is for is the giver's choice
(``extproc.pool.shared.leases``): a replica of the most urgent band waiting, drawn in proportion to
its waiters, so within one band the pool's slots go to replicas as their waiters are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from extproc.pool.shared.prelude import PRELUDE

__all__ = [
    "ACQUIRE",
    "MAX_DIGITS",
    "MAX_TABLE_BYTES",
    "RENEW",
    "RETURN",
    "DemandError",
    "Keys",
    "decode_demand",
    "encode_demand",
    "encode_limit",
    "show",
]

# A band or a count written as text has at most this many digits (int64's range; ``int``
# never reads more), and a demand table at most this many bytes (some 300 bands).
MAX_DIGITS = 18
MAX_TABLE_BYTES = 4096


class DemandError(ValueError):
    """A demand table that no replica writes (``decode_demand`` says what is wrong)."""


@dataclass(frozen=True, slots=True)
class Keys:
    leases: str
    replicas: str
    demand: str
    leader: str
    limit: str
    handoff: str
    epoch: str
    fence: str
    policies: str
    channel: str

    @classmethod
    def for_prefix(cls, prefix: str) -> Keys:
        tag = "{" + prefix + "}"
        return cls(
            leases=f"{tag}:leases",
            replicas=f"{tag}:replicas",
            demand=f"{tag}:demand",
            leader=f"{tag}:leader",
            limit=f"{tag}:limit",
            handoff=f"{tag}:handoff",
            epoch=f"{tag}:epoch",
            fence=f"{tag}:fence",
            policies=f"{tag}:policies",
            channel=f"{tag}:events",
        )

    @property
    def all(self) -> list[str]:
        """KEYS of every script, in this order."""
        return [
            self.leases,
            self.replicas,
            self.demand,
            self.leader,
            self.limit,
            self.handoff,
            self.epoch,
            self.fence,
            self.policies,
        ]


def encode_demand(demand: Mapping[int, int]) -> str:
    """{band: waiters} -> ``band:count,...``, most urgent first, zero counts left out."""
    return ",".join(f"{band}:{n}" for band, n in sorted(demand.items()) if n > 0)


def decode_demand(text: str | bytes) -> dict[int, int]:
    """``band:count,...`` -> {band: waiters} ('' none; zero counts left out, a band twice
    summed). Raises ``DemandError`` for a table no replica writes: longer than
    ``MAX_TABLE_BYTES``, not UTF-8, an item that is not ``band:count`` in ASCII digits, or a
    number of more than ``MAX_DIGITS`` digits (checked before ``int`` reads it). The cost is
    linear in the table, and the table is at most ``MAX_TABLE_BYTES``."""
    if len(text) > MAX_TABLE_BYTES:
        raise DemandError(f"a table of {len(text)} bytes (at most {MAX_TABLE_BYTES})")
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError as e:
            raise DemandError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    out: dict[int, int] = {}
    if not text:
        return out
    for item in text.split(","):
        band, sep, n = item.partition(":")
        if not (sep and _digits(band) and _digits(n)):
            raise DemandError(f"the item {show(item)} is not band:count")
        if len(band) > MAX_DIGITS or len(n) > MAX_DIGITS:
            raise DemandError(
                f"the item {show(item)} has a number of more than {MAX_DIGITS} digits"
            )
        if int(n) > 0:
            out[int(band)] = out.get(int(band), 0) + int(n)
    return out


def encode_limit(own: int, least: int, most: int) -> str:
    """ARGV 3 of every script: the caller's limit (used while no leader publishes one) and the
    bounds a published limit is clamped to (its policy's)."""
    return f"{own}:{least}:{most}"


def show(value: str | bytes, keep: int = 24) -> str:
    """``value`` for an error message: its start, and its length when cut."""
    if len(value) <= keep:
        return repr(value)
    unit = "bytes" if isinstance(value, bytes) else "characters"
    return f"{value[:keep]!r}... ({len(value)} {unit})"


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


_PRELUDE = PRELUDE.replace("MAX_DIGITS", str(MAX_DIGITS))  # (Lua has no constants of ours)

# ACQUIRE: ARGV 5 the caller's ask (``band:count,...``), 6.. candidate lease ids, as many as
# the ask's total. Grants the first ``granted`` ids (none while the fence stands: the caller
# is expected to re-register). Returns {granted, count, limit, others' demand as [replica,
# table, ...], epoch, fenced (1 or 0)}.
ACQUIRE = (
    _PRELUDE
    + """
local mine = parse(ARGV[5], {})
local theirs, flat = others()
local bands, seen = {}, {}
for b, _ in pairs(mine) do if not seen[b] then seen[b] = true; bands[#bands + 1] = b end end
for b, _ in pairs(theirs) do if not seen[b] then seen[b] = true; bands[#bands + 1] = b end end
table.sort(bands)
-- Slots handed to me first (what I no longer want of them is free again).
expect(me)
local handed = fenced and 0 or (handoffs[me] or 0)
if handed > 0 then
  redis.call('HDEL', KEYS[6], me)
  reserved = reserved - handed
end
local count = redis.call('ZCARD', KEYS[1]) + reserved
local free = fenced and 0 or limit - count
local granted = 0
local left = {}
for _, b in ipairs(bands) do
  local m, o = mine[b] or 0, theirs[b] or 0
  local take = math.min(m, handed)
  handed = handed - take
  free = free - take
  count = count + take
  if m - take > 0 and free > 0 then
    local more = m - take
    if o > 0 then more = math.min(more, math.ceil(free * m / (m + o))) end
    more = math.min(more, free)
    take = take + more
    free = free - more
    count = count + more
  end
  free = free - math.min(o, math.max(free, 0))
  granted = granted + take
  left[b] = m - take
end
for i = 1, granted do redis.call('ZADD', KEYS[1], now + lease_ms, ARGV[5 + i]) end
set_demand(encode(left))
return {granted, count, limit, flat, epoch, seal()}
"""
)

# RETURN: ARGV 5 the caller's demand (``band:count,...``), '-' to leave it, or 'bye' (the
# replica stops: forget its demand, its entry and its leadership); 6 the replica the slots are
# for ('' anyone), 7 how long they are kept for it (ms); 8.. lease ids to give back.
# Publishes 'freed' when it gave any back and somebody else waits. While the fence stands the
# caller is expected to re-register, unless it leaves.
# Returns {given back, count, limit, epoch, fenced}.
RETURN = (
    _PRELUDE
    + """
local n = 0
for i = 8, #ARGV do n = n + redis.call('ZREM', KEYS[1], ARGV[i]) end
local to = ARGV[6]
if to ~= '' and n > 0 then
  local alive = redis.call('ZSCORE', KEYS[2], to)
  if alive and tonumber(alive) > now then
    local total = (handoffs[to] or 0) + n
    redis.call('HSET', KEYS[6], to, total .. ':' .. (now + tonumber(ARGV[7])))
    reserved = reserved + n
    redis.call('PUBLISH', channel, 'freed ' .. me .. ' ' .. n .. ' ' .. to)
  else
    to = ''
  end
end
local ended = false
if ARGV[5] == 'bye' then
  if fenced then redis.call('HDEL', KEYS[8], me) end
  ended = settle()
  set_demand('')
  redis.call('ZREM', KEYS[2], me)
  step_down()
else
  expect(me)
  if ARGV[5] ~= '-' then set_demand(ARGV[5]) end
end
if ((n > 0 and to == '') or ended) and others_wait() then
  redis.call('PUBLISH', channel, 'freed ' .. me .. ' ' .. n)
end
return {n, redis.call('ZCARD', KEYS[1]) + reserved, limit, epoch, seal()}
"""
)

# RENEW, the one call per interval: ARGV 5 the caller's demand, 6 '1' if it would lead (an
# adaptive pool), 7 the limit it publishes if it leads, ``<limit>@<term>`` ('' none; another
# term than the one in force: refused), 8 how many ids to renew,
# 9 to give back, 10 to claim, 11 how many replicas it names (those it last saw live), with
# ``:fresh`` after the number when it has never seen the pool outside a fence (it has just
# started: it cannot know who ran before a loss); then those ids and replicas in that order.
# Renewed ids that have expired (Redis was unreachable for longer than
# the lease, or restarted) and claimed ids (running requests that hold no lease: the replica
# rejoins) are added while the pool has room; the rest are reported lost. While the fence
# stands, this re-registers the caller, and the replicas it names are expected; only a
# caller that is not fresh says who runs (lifts ``#``), so a fresh one alone never ends it.
# Returns
# {count, limit, leader, lost ids, claimed, live replicas, others' demand as [replica, table,
# ...], epoch, fenced, the leader's term (0 none), other policies live on this prefix}.
RENEW = (
    _PRELUDE
    + """
local n_renew, n_back, n_claim = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local first = 12
local back = 0
for i = first + n_renew, first + n_renew + n_back - 1 do
  back = back + redis.call('ZREM', KEYS[1], ARGV[i])
end
local leader, term = leader_of()
if ARGV[6] == '1' then
  if not leader then  -- a term after the last one, even one that ended in this millisecond
    leader, term = me, math.max(now, term + 1)
    redis.call('SET', KEYS[4], term .. ':' .. me, 'PX', lease_ms)
  elseif leader == me then
    redis.call('PEXPIRE', KEYS[4], lease_ms)
  end
elseif leader == me then
  step_down()
  leader = false
end
if not leader then term = 0 end
local raised = false
local new, of_term = string.match(ARGV[7], '^(%d+)@(%d+)$')
if leader == me and new and #new <= max_digits and tonumber(of_term) == term then
  new = math.floor(math.min(most, math.max(least, tonumber(new))))
  raised = new > limit
  redis.call('SET', KEYS[5], new, 'PX', 3 * lease_ms)
  limit = new
end
local missing = {}
for i = first, first + n_renew - 1 do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', now + lease_ms, ARGV[i])
  else
    missing[#missing + 1] = ARGV[i]
  end
end
local count = redis.call('ZCARD', KEYS[1]) + reserved
local lost = {}
for _, id in ipairs(missing) do
  if count < limit then
    redis.call('ZADD', KEYS[1], now + lease_ms, id)
    count = count + 1
  else
    lost[#lost + 1] = id
  end
end
local claimed = 0
for i = first + n_renew + n_back, first + n_renew + n_back + n_claim - 1 do
  if count >= limit then break end
  redis.call('ZADD', KEYS[1], now + lease_ms, ARGV[i])
  count = count + 1
  claimed = claimed + 1
end
local ended = false
if fenced then
  local named, fresh = string.match(ARGV[11], '^(%d+)(.*)$')
  if fresh ~= ':fresh' then redis.call('HDEL', KEYS[8], '#') end
  redis.call('HSET', KEYS[8], me, '1')
  local known = first + n_renew + n_back + n_claim
  for i = known, known + tonumber(named) - 1 do
    redis.call('HSETNX', KEYS[8], ARGV[i], '0')
  end
  ended = settle()
end
set_demand(ARGV[5])
if (back > 0 or expired > 0 or #dead > 0 or raised or ended) and others_wait() then
  redis.call('PUBLISH', channel, 'freed ' .. me .. ' ' .. back)
end
local policies = 0
if string.match(ARGV[3], '^%d+:%d+:%d+$') then
  local mine = least .. ':' .. most
  redis.call('HSET', KEYS[9], mine, now + lease_ms)
  local p = redis.call('HGETALL', KEYS[9])
  for i = 1, #p, 2 do
    local exp = tonumber(p[i + 1])
    if not exp or exp <= now then
      redis.call('HDEL', KEYS[9], p[i])
    elseif p[i] ~= mine then
      policies = policies + 1
    end
  end
end
local _, flat = others()
local live = redis.call('ZRANGEBYSCORE', KEYS[2], now, '+inf')
return {count, limit, leader or '', lost, claimed, live, flat, epoch, seal(), term, policies}
"""
)
