-- Fragment (not a script on its own): crawl-wide politeness for sync.lua (SCHEDULER_POLITENESS = "cluster").
--
-- In this mode every queue member is  <domain> \0 <11-digit priority key> <6-byte seq> <payload>  with
-- score 0, so ZRANGEBYLEX over "<domain>\0" reads one domain's requests in priority-then-FIFO order
-- from the one queue ZSET. Per domain, the info HASH (KEYS[12] of sync.lua) holds
--   b:<domain>  backlog (queued requests)      i:<domain>  leased requests (concurrency slots in use)
--   n:<domain>  next allowed lease time        l:<domain>  limits "delay concurrency jitter"
-- and the domains ZSET (KEYS[11]) holds every domain with a backlog, scored by when it may next be
-- leased from (BLOCKED while all its slots are taken). Slots are leases: a dead worker's expire, and
-- the sweep gives them back. The next allowed time moves to (lease time + delay) on lease and to
-- (finish time + delay) on acknowledgement, so two fetches of a domain are at least `delay` apart
-- even when a leased request waits in a worker's prefetch buffer.

local BLOCKED = 1e15
-- a penalty (429/503, Retry-After) pushes a domain back by at most an hour (politeness.py), a delay by the
-- domain's limits: a next allowed time further ahead than that is garbage (see pol_check)
local MAX_PENALTY = 3600
-- bounds of the limits read from l:<domain> (written by the workers from their settings; garbage is
-- clamped into them): a delay of at most a day, a jitter of at most ten times the delay -- and at most
-- pol.max_delay and pol.max_jitter, the largest the calling worker's settings give any domain (sync.lua's
-- head 'limits_bound'): an l: written after a domain's last enqueue is never rewritten, so garbage there
-- must not park its backlog
local MAX_DELAY, MAX_JITTER = 86400, 10
-- pol.queue, pol.leases, pol.now, pol.max_delay, pol.max_jitter: set by sync.lua before the first call below
local pol = {touched = {}, checked = {}, max_delay = MAX_DELAY, max_jitter = MAX_JITTER}

local function finite_in(s, lo, hi)
  local x = tonumber(s)
  if not x or x ~= x then return lo end
  return math.min(hi, math.max(lo, x))
end

-- A domain's limits; a value past the bounds is written back clamped (once: pol.clamped makes sync.lua
-- name the info HASH among the keys it repaired).
local function pol_limits(info_key, dom)
  local l = redis.call('HGET', info_key, 'l:' .. dom)
  if not l then return 0, 0, 0 end
  local delay, conc, jitter = string.match(l, '^(%S+) (%S+) (%S+)$')
  local d, c, j = finite_in(delay, 0, pol.max_delay), math.floor(finite_in(conc, 0, 1e9)),
                  finite_in(jitter, 0, pol.max_jitter)
  if d ~= tonumber(delay) or j ~= tonumber(jitter) or c ~= tonumber(conc) then
    redis.call('HSET', info_key, 'l:' .. dom, string.format('%.17g %d %.17g', d, c, j))
    pol.clamped = true
  end
  return d, c, j
end

local function int16(s)
  return s and string.match(s, '^%-?%d+$') and #s <= 16 and tonumber(s) or nil
end

-- The latest next allowed time a domain can legitimately have now.
local function pol_horizon(info_key, dom)
  local delay, _, jitter = pol_limits(info_key, dom)
  return pol.now + math.max(MAX_PENALTY, delay * (1 + jitter)) + 1
end

-- Scripts validate before they write: the first time a call touches a domain, its counters b: and i:
-- must be integers Redis can HINCRBY (|x| < 2^52), not negative, and n: a finite number no further ahead
-- than the domain's limits allow (pol_horizon). A garbage or negative backlog is recounted (ZLEXCOUNT
-- over the domain's range of the queue, O(log N)), garbage slots and next time reset to 0 (and a backlog
-- that finds nothing is reset by pol_lease). One HMGET per domain per call. (A count of slots too high
-- is pol_unstick's: only at the end of a call is "no more slots in use than leases" exact.)
local function pol_check(info_key, dom)
  if pol.checked[dom] then return end
  pol.checked[dom] = true
  local v = redis.call('HMGET', info_key, 'b:' .. dom, 'i:' .. dom, 'n:' .. dom)
  local b, i = int16(v[1]), int16(v[2])
  if v[1] and not (b and b >= 0) then
    redis.call('HSET', info_key, 'b:' .. dom,
               redis.call('ZLEXCOUNT', pol.queue, '[' .. dom .. '\0', '(' .. dom .. '\1'))
  end
  if v[2] and not (i and i >= 0) then redis.call('HSET', info_key, 'i:' .. dom, 0) end
  local n = v[3] and tonumber(v[3])
  -- (the limits are read only for a time more than a penalty ahead: a long delay)
  if v[3] and not (n and n == n and n > -1e15
                   and (n <= pol.now + MAX_PENALTY or n <= pol_horizon(info_key, dom))) then
    redis.call('HSET', info_key, 'n:' .. dom, 0)
  end
end

local function pol_domain(member)
  return string.match(member, '^([^%z]*)%z')
end

-- Count a change of backlog (db) and slots in use (di) for a domain; rescheduled in pol_flush.
local function pol_count(info_key, dom, db, di)
  pol_check(info_key, dom)
  if db ~= 0 then redis.call('HINCRBY', info_key, 'b:' .. dom, db) end
  if di ~= 0 then redis.call('HINCRBY', info_key, 'i:' .. dom, di) end
  pol.touched[dom] = true
end

local function pol_push_next(info_key, dom, t)
  pol_check(info_key, dom)
  local cur = tonumber(redis.call('HGET', info_key, 'n:' .. dom) or '0')
  if t > cur then redis.call('HSET', info_key, 'n:' .. dom, t) end
  pol.touched[dom] = true
end

-- The jitter only lengthens a delay (by up to `jitter` times it): the delay stays a minimum gap.
local function pol_jitter(delay, jitter)
  if jitter > 0 then return delay * jitter * math.random() end
  return 0
end

-- A request of `dom` finished (acknowledged): its slot is free, its delay runs from now.
local function pol_finished(info_key, dom, now)
  local delay, _, jitter = pol_limits(info_key, dom)
  if delay > 0 then pol_push_next(info_key, dom, now + delay + pol_jitter(delay, jitter)) end
end

local function pol_schedule(domains_key, info_key, dom, now)
  local backlog = tonumber(redis.call('HGET', info_key, 'b:' .. dom) or '0')
  if backlog <= 0 then
    redis.call('ZREM', domains_key, dom)
    return
  end
  local _, conc = pol_limits(info_key, dom)
  local used = tonumber(redis.call('HGET', info_key, 'i:' .. dom) or '0')
  if conc > 0 and used >= conc then
    redis.call('ZADD', domains_key, BLOCKED, dom)
  else
    local nxt = tonumber(redis.call('HGET', info_key, 'n:' .. dom) or '0')
    redis.call('ZADD', domains_key, math.max(nxt, 0), dom)
  end
end

-- A domain scheduled more than MAX_PENALTY ahead (BLOCKED included) is taken up again only when a call
-- touches it: one whose counters or score someone wrote garbage into would wait for ever. Each call checks
-- one such domain, picked at random: slots in use past the leases there are (garbage) come down to that
-- count, and pol_flush schedules it again from its (checked) counters.
local function pol_unstick(domains_key, info_key, now)
  local first = redis.call('ZCOUNT', domains_key, '-inf', now + MAX_PENALTY)
  local total = redis.call('ZCARD', domains_key)
  if total <= first then return end
  local rank = first + math.random(0, total - first - 1)
  local dom = redis.call('ZRANGE', domains_key, rank, rank)[1]
  if not dom then return end
  pol_check(info_key, dom)
  local used = int16(redis.call('HGET', info_key, 'i:' .. dom)) or 0
  local leases = redis.call('ZCARD', pol.leases)
  if used > leases then redis.call('HSET', info_key, 'i:' .. dom, leases) end
  pol.touched[dom] = true
end

local function pol_flush(domains_key, info_key, now)
  for dom in pairs(pol.touched) do pol_schedule(domains_key, info_key, dom, now) end
  pol.touched = {}
end

-- Lease up to n requests from domains that may be fetched now; returns a flat list lease key, score.
-- on_lease(m) takes a member out of the queue into a lease and returns its lease key, or returns false
-- when it refused the member (rejected it: it leaves the queue without taking a slot).
local function pol_lease(queue_key, domains_key, info_key, n, now, on_lease)
  local out = {}
  local got = 0
  local ready = redis.call('ZRANGEBYSCORE', domains_key, '-inf', now, 'LIMIT', 0, 256)
  for _, dom in ipairs(ready) do
    if got >= n then break end
    pol_check(info_key, dom)
    local delay, conc, jitter = pol_limits(info_key, dom)
    local can = n - got
    if conc > 0 then
      local used = tonumber(redis.call('HGET', info_key, 'i:' .. dom) or '0')
      can = math.min(can, conc - used)
    end
    if delay > 0 then can = math.min(can, 1) end
    if can > 0 then
      local ms = redis.call('ZRANGEBYLEX', queue_key, '[' .. dom .. '\0', '(' .. dom .. '\1', 'LIMIT', 0, can)
      local taken = 0
      for _, m in ipairs(ms) do
        redis.call('ZREM', queue_key, m)
        local key = on_lease(m)
        if key then
          out[#out + 1] = key; out[#out + 1] = '0'
          got = got + 1
          taken = taken + 1
        end
      end
      if #ms == 0 then
        redis.call('HSET', info_key, 'b:' .. dom, 0)  -- heal a drifted counter rather than spin on it
      else
        pol_count(info_key, dom, -#ms, taken)
        if delay > 0 and taken > 0 then pol_push_next(info_key, dom, now + delay + pol_jitter(delay, jitter)) end
      end
    end
    pol.touched[dom] = true
  end
  return out
end
