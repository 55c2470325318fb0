"""The Lua prelude every script of the shared pool starts with (``scripts``: the keys, and
the scripts that follow it).

ARGV common to every script: 1 replica id, 2 lease (ms), 3 the caller's limit (used when
no leader publishes one), alone or as ``limit:least:most`` (``encode_limit``: a published
limit is clamped to least..most, one that is not a number ignored), 4 the events channel.

Then it reads the time, the epoch and its fence, drops expired leases and dead replicas,
refreshes the caller's entry, reads the limit and the slots handed to replicas, and defines the
helpers the scripts share. ``MAX_DIGITS`` stands for ``scripts.MAX_DIGITS`` (Lua has no
constants of ours: ``scripts`` puts the number in).
"""

from __future__ import annotations

__all__ = ["PRELUDE"]

PRELUDE = """
if redis.replicate_commands then redis.replicate_commands() end
local me, lease_ms, channel = ARGV[1], tonumber(ARGV[2]), ARGV[4]
local max_digits = MAX_DIGITS
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- The epoch: a new one when the state is missing or stale (see the keys above).
local epoch, seen, lives = string.match(redis.call('GET', KEYS[7]) or '', '^(%d+):(%d+):(%d+)$')
local reset = not epoch or #epoch > MAX_DIGITS or #seen > MAX_DIGITS or #lives > MAX_DIGITS
if not reset then
  epoch, seen, lives = tonumber(epoch), tonumber(seen), tonumber(lives)
  reset = now - seen > lease_ms or (lives > now and redis.call('EXISTS', KEYS[1]) == 0)
end
if reset then
  epoch, lives = now, now
  redis.call('DEL', KEYS[8])
  redis.call('HSET', KEYS[8], '#', '0')
  redis.call('PEXPIRE', KEYS[8], lease_ms)
end
local fenced = redis.call('EXISTS', KEYS[8]) == 1
local expired = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, r in ipairs(dead) do redis.call('HDEL', KEYS[3], r) end
if #dead > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
redis.call('ZADD', KEYS[2], now + lease_ms, me)
local own, least, most = string.match(ARGV[3], '^(%d+):(%d+):(%d+)$')
if own then
  own, least, most = tonumber(own), tonumber(least), tonumber(most)
else
  own, least, most = tonumber(ARGV[3]), 0, math.huge
end
local limit = tonumber(redis.call('GET', KEYS[5]) or '')
if limit == nil or limit ~= limit then limit = own end
limit = math.floor(math.min(most, math.max(least, limit)))
-- Slots handed to a replica: reserved (they count as taken) until their expiry; an entry no
-- replica writes is dropped.
local handoffs, reserved = {}, 0
local ho = redis.call('HGETALL', KEYS[6])
for i = 1, #ho, 2 do
  local n, exp = string.match(ho[i + 1], '^(%d+):(%d+)$')
  if not n or #n > MAX_DIGITS or #exp > MAX_DIGITS or tonumber(exp) <= now then
    redis.call('HDEL', KEYS[6], ho[i])
  else
    handoffs[ho[i]] = tonumber(n)
    reserved = reserved + tonumber(n)
  end
end

local function parse(s, into)
  for b, c in string.gmatch(s, '(%d+):(%d+)') do
    if #b <= MAX_DIGITS and #c <= MAX_DIGITS then
      b = tonumber(b)
      into[b] = (into[b] or 0) + tonumber(c)
    end
  end
  return into
end

-- Everyone else's demand: the merged table and the raw entries (for the caller's view).
local function others()
  local merged, flat = {}, {}
  local all = redis.call('HGETALL', KEYS[3])
  for i = 1, #all, 2 do
    if all[i] ~= me then
      parse(all[i + 1], merged)
      flat[#flat + 1] = all[i]
      flat[#flat + 1] = all[i + 1]
    end
  end
  return merged, flat
end

local function encode(tbl)
  local bands = {}
  for b, n in pairs(tbl) do if n > 0 then bands[#bands + 1] = b end end
  table.sort(bands)
  local parts = {}
  for _, b in ipairs(bands) do parts[#parts + 1] = b .. ':' .. tbl[b] end
  return table.concat(parts, ',')
end

-- Write the caller's demand; tell the others when it changed.
local function set_demand(text)
  local old = redis.call('HGET', KEYS[3], me)
  if text == '' then
    if old then
      redis.call('HDEL', KEYS[3], me)
      redis.call('PUBLISH', channel, 'demand ' .. me .. ' ')
    end
  elseif old ~= text then
    redis.call('HSET', KEYS[3], me, text)
    redis.call('PUBLISH', channel, 'demand ' .. me .. ' ' .. text)
  end
end

-- The fence: ``who`` runs something and has not re-registered it yet.
local function expect(who)
  if fenced then redis.call('HSETNX', KEYS[8], who, '0') end
end

-- The fence ends when nobody expected is left and a RENEW not fresh said who runs ('#'
-- gone); true when it did now.
local function settle()
  if not fenced then return false end
  local f = redis.call('HGETALL', KEYS[8])
  for i = 1, #f, 2 do
    if f[i] == '#' or f[i + 1] == '0' then return false end
  end
  redis.call('DEL', KEYS[8])
  fenced = false
  return true
end

-- Every script ends here: the epoch, when it ran, until when its leases live.
local function seal()
  if redis.call('EXISTS', KEYS[1]) == 1 then
    lives = math.max(lives, now + lease_ms)
  else
    lives = now
  end
  redis.call('SET', KEYS[7], epoch .. ':' .. now .. ':' .. lives)
  return fenced and 1 or 0
end

-- The leader and its term (``<term>:<replica>``; a bare id, of an older version: term 0).
-- ``<term>:`` is the mark a leader that stepped down leaves for a lease: no leader, and the
-- last term, so that the next one's is later even within the same millisecond.
local function leader_of()
  local v = redis.call('GET', KEYS[4])
  if not v then return false, 0 end
  local t, who = string.match(v, '^(%d+):(.*)$')
  if t and #t <= MAX_DIGITS then
    if who == '' then return false, tonumber(t) end
    return who, tonumber(t)
  end
  return v, 0
end

-- Step down, if ``me`` leads: leave the mark of the term that ends.
local function step_down()
  local who, t = leader_of()
  if who == me then redis.call('SET', KEYS[4], t .. ':', 'PX', lease_ms) end
end

-- Whether anybody else waits (a 'freed' message is worth sending).
local function others_wait()
  local n = redis.call('HLEN', KEYS[3])
  if redis.call('HEXISTS', KEYS[3], me) == 1 then n = n - 1 end
  return n > 0
end
"""
