-- Fragment (not a script on its own): crawl-wide politeness for sync.lua (SCHEDULER_POLITENESS = "cluster").
--
-- In this mode every queue member is  <domain> \0 <11-digit priority key> <6-byte seq> <payload>  with
-- score 0, so ZRANGEBYLEX over "<domain>\0" reads one domain's requests in priority-then-FIFO order
-- from the one queue ZSET. Per domain, the info HASH (KEYS[12] of sync.lua) holds one field
--   s:<domain>  "<backlog> <slots> <next> <delay> <concurrency> <jitter>"
-- backlog: queued requests; slots: leased requests (concurrency slots in use); next: the next allowed
-- lease time; then the domain's limits as the last worker that enqueued one of its requests wrote them.
-- Layout before: four fields b:<domain>, i:<domain>, n:<domain> and l:<domain> (the same values; read by
-- HMGET per domain and call). The field 'layout' = 's' says the HASH holds no such fields: written when a
-- call finds the HASH absent (a crawl started by this version). In a HASH without it (a crawl started by
-- an older version, upgraded in place), a domain with no s: field is read from its old fields
-- (pol_legacy: one HMGET more, for a domain not seen since the upgrade) and written back as s:, its old
-- fields deleted: the crawl goes on where it was. Workers of both versions must not run at the same time
-- (an older worker would count in the b:/i: fields a newer one no longer reads): stop the older first.
-- The domains ZSET (KEYS[11]) holds every domain with a backlog, scored by when it may next be
-- leased from (BLOCKED while all its slots are taken): a lease looks only at the domains that are due.
-- Slots are leases: a dead worker's expire, and the sweep gives them back. The next allowed time moves
-- to (lease time + delay) on lease and to (finish time + delay) on acknowledgement, so two fetches of a
-- domain are at least `delay` apart even when a leased request waits in a worker's prefetch buffer.
--
-- A call reads a domain's field once (one HGET, checked: pol_state), keeps it in pol.st while it counts,
-- leases and finishes, and writes it back if it changed in one HSET, and the domain's schedule in one ZADD
-- or ZREM only if its score changed (pol_flush): a domain costs two or three commands per call, not a few
-- per request.

local BLOCKED, BLOCKED_S = 1e15, '1e15'
-- a penalty (429/503, Retry-After) pushes a domain back by at most an hour (politeness.py), a delay by the
-- domain's limits: a next allowed time further ahead than that is garbage (see pol_state)
local MAX_PENALTY = 3600
-- bounds of the limits read from s:<domain> (written by the workers from their settings; garbage is
-- clamped into them): a delay of at most a day, a jitter of at most ten times the delay -- and at most
-- pol.max_delay and pol.max_jitter, the largest the calling worker's settings give any domain (sync.lua's
-- head 'limits_bound'): limits written after a domain's last enqueue are never rewritten, so garbage there
-- must not park its backlog
local MAX_DELAY, MAX_JITTER = 86400, 10

-- Small integers as decimal strings, made once (a FUNCTION library keeps them between calls): a number
-- handed to redis.call is printed by Redis with %.17g, and string.format costs nearly as much.
local DECIMAL = {}
local function decimal(x)
  local s = DECIMAL[x]
  if s then return s end
  s = string.format('%d', x)
  if x >= 0 and x < 4096 then DECIMAL[x] = s end
  return s
end
-- pol.queue, pol.leases, pol.now (and now_s, as Redis writes it), pol.max_delay, pol.max_jitter: set by
-- sync.lua (pol_reset) before the first call below.
-- pol.st[dom]: the domain's fields as this call knows them; pol.touched[dom]: its schedule is to be redone.
-- pol is the call's own: pol_reset() at the start of every call (a FUNCTION library keeps it between calls).
local pol
local function pol_reset(now, now_s, queue, leases, info)
  pol = {st = {}, touched = {}, limits = {}, max_delay = MAX_DELAY, max_jitter = MAX_JITTER, now = now,
         now_s = now_s, queue = queue, leases = leases, info = info}
end

local function finite_in(s, lo, hi)
  local x = tonumber(s)
  if not x or x ~= x then return lo end
  return math.min(hi, math.max(lo, x))
end

-- a counter as written: an integer Redis can hold (|x| < 2^52), or nil
local function int_of52(s)
  local x = s and tonumber(s)
  if x and x == math.floor(x) and x > -4503599627370496 and x < 4503599627370496 then return x end
  return nil
end

-- Parse limits "delay concurrency jitter" into st, clamped into the bounds; a value past them is written
-- back clamped (pol.clamped makes sync.lua name the info HASH among the keys it repaired). No limits
-- (nil) are none: "0 0 0".
local function pol_parse_limits(st, l)
  st.l = l
  if not l then st.l, st.d, st.c, st.j = '0 0 0', 0, 0, 0; return end
  local known = pol.limits[l]  -- most domains share a few limit strings: parsed once per call
  if not known then
    local delay, conc, jitter = string.match(l, '^(%S+) (%S+) (%S+)$')
    local d, c, j = finite_in(delay, 0, pol.max_delay), math.floor(finite_in(conc, 0, 1e9)),
                    finite_in(jitter, 0, pol.max_jitter)
    local clean = d == tonumber(delay) and j == tonumber(jitter) and c == tonumber(conc)
    known = {d, c, j, not clean and string.format('%.17g %d %.17g', d, c, j)}
    pol.limits[l] = known
  end
  st.d, st.c, st.j = known[1], known[2], known[3]
  if known[4] then
    st.l = known[4]
    st.w = true
    pol.clamped = true
  end
end

-- Where the domains ZSET holds a domain, from its fields: false (not there: no backlog), BLOCKED (all its
-- slots taken), else its next allowed time (at least 0).
local function pol_score(st)
  if st.b <= 0 then return false end
  if st.c > 0 and st.i >= st.c then return BLOCKED end
  return math.max(st.n, 0)
end

-- the older layout's four fields of a domain without an s: field, or nil (none: a domain never seen)
local function pol_legacy(dom)
  if pol.layout == nil then
    -- once per call: a HASH marked, or none yet (then marked by pol_flush), holds no old fields
    pol.layout = redis.call('HGET', pol.info, 'layout') == 's'
    if not pol.layout and redis.call('EXISTS', pol.info) == 0 then pol.layout, pol.mark = true, true end
  end
  if pol.layout then return nil end
  local v = redis.call('HMGET', pol.info, 'b:' .. dom, 'i:' .. dom, 'n:' .. dom, 'l:' .. dom)
  if v[1] or v[2] or v[3] or v[4] then return v end
  return nil
end

-- The domain's fields, read once per call and validated before anything is written: backlog and slots
-- integers Redis can hold (|x| < 2^52), not negative, and next a finite number no further ahead than the
-- domain's limits allow. A garbage or negative backlog is recounted (ZLEXCOUNT over the domain's range
-- of the queue, O(log N)), garbage slots and next time reset to 0 (a backlog that finds nothing is reset
-- by pol_lease; slots in use past the leases there are, by pol_unstick); a field that is not four values
-- is all garbage. st.w: st is to be written back (pol_flush).
local function pol_state(dom)
  local st = pol.st[dom]
  if st then return st end
  local field = 's:' .. dom
  local raw = redis.call('HGET', pol.info, field)
  local vb, vi, vn, vl
  local legacy
  if raw then
    vb, vi, vn, vl = string.match(raw, '^(%S+) (%S+) (%S+) (.*)$')
    if not vb then vb, vi, vn = 'garbage', 'garbage', 'garbage' end
  else
    legacy = pol_legacy(dom)
    if legacy then vb, vi, vn, vl = legacy[1], legacy[2], legacy[3], legacy[4] end
  end
  st = {field = field, legacy = legacy, w = legacy ~= nil}
  pol.st[dom] = st
  pol_parse_limits(st, vl)
  local b, i = int_of52(vb), int_of52(vi)
  if vb and not (b and b >= 0) then
    b = redis.call('ZLEXCOUNT', pol.queue, '[' .. dom .. '\0', '(' .. dom .. '\1')
    st.w = true
  end
  if vi and not (i and i >= 0) then i = 0; st.w = true end
  st.b, st.i = b or 0, i or 0
  local n = vn and tonumber(vn)
  local horizon = pol.now + math.max(MAX_PENALTY, st.d * (1 + st.j)) + 1
  if vn and not (n and n == n and n > -1e15 and n <= horizon) then n = 0; vn = nil; st.w = true end
  st.n, st.n_s = n or 0, vn or '0'
  -- the domain's place in the domains ZSET, as its fields say it is (pol_flush writes it only when it
  -- changes); unknown (nil: written at the first flush) when a field was repaired
  if not st.w then st.scheduled = pol_score(st) end
  return st
end

local function pol_domain(member)
  return string.match(member, '^([^%z]*)%z')
end

-- A worker's limits for the domain, as it enqueues one of its requests (the last writer's hold).
local function pol_remember_limits(dom, limits)
  local st = pol_state(dom)
  if st.l ~= limits then
    st.w = true
    pol_parse_limits(st, limits)
    pol.touched[dom] = true  -- a new concurrency can block or free it
  end
end

-- Count a change of backlog (db) and slots in use (di) for a domain; rescheduled in pol_flush.
local function pol_count(dom, db, di)
  local st = pol_state(dom)
  if db ~= 0 then st.b = st.b + db; st.w = true end
  if di ~= 0 then st.i = st.i + di; st.w = true end
  pol.touched[dom] = true
end

local function pol_push_next(dom, t)
  local st = pol_state(dom)
  if t > st.n then st.n, st.n_s = t, nil; st.w = true end
  pol.touched[dom] = true
end

-- The jitter only lengthens a delay (by up to `jitter` times it): the delay stays a minimum gap.
local function pol_jitter(delay, jitter)
  if jitter > 0 then return delay * jitter * math.random() end
  return 0
end

-- A request of `dom` finished (acknowledged): its slot is free, its delay runs from now.
local function pol_finished(dom, now)
  local st = pol_state(dom)
  if st.d > 0 then pol_push_next(dom, now + st.d + pol_jitter(st.d, st.j)) end
end

-- A domain scheduled more than MAX_PENALTY ahead (BLOCKED included) is taken up again only when a call
-- touches it: one whose counters or score someone wrote garbage into would wait for ever. Each call that
-- checks (sync.lua) looks at one such domain, picked at random: slots in use past the leases there are
-- (garbage) come down to that count, and pol_flush schedules it again from its (checked) counters.
local function pol_unstick(domains_key, now)
  local first = redis.call('ZCOUNT', domains_key, '-inf', now + MAX_PENALTY)
  local total = redis.call('ZCARD', domains_key)
  if total <= first then return end
  local rank = first + math.random(0, total - first - 1)
  local dom = redis.call('ZRANGE', domains_key, rank, rank)[1]
  if not dom then return end
  local st = pol_state(dom)
  local leases = redis.call('ZCARD', pol.leases)
  if st.i > leases then st.i = leases; st.w = true end
  pol.touched[dom] = true
  st.scheduled = nil  -- its score is not what its fields say: written again
end

-- Write back what changed (one HSET per domain; a domain read from the older layout loses its old
-- fields) and schedule every touched domain (one ZADD or ZREM, skipped when its score is the one the ZSET
-- holds: what its fields said when read, what this call wrote or what pol_lease read).
local function pol_flush(domains_key, now)
  if pol.mark then redis.call('HSET', pol.info, 'layout', 's'); pol.mark = nil end
  for _, st in pairs(pol.st) do
    if st.w then
      if not st.n_s then st.n_s = st.n == 0 and '0' or string.format('%.17g', st.n) end
      redis.call('HSET', pol.info, st.field, decimal(st.b) .. ' ' .. decimal(st.i) .. ' ' .. st.n_s .. ' ' .. st.l)
      st.w = false
      if st.legacy then
        local dom = string.sub(st.field, 3)
        redis.call('HDEL', pol.info, 'b:' .. dom, 'i:' .. dom, 'n:' .. dom, 'l:' .. dom)
        st.legacy = nil
      end
    end
  end
  for dom in pairs(pol.touched) do
    local st = pol.st[dom]
    local score = pol_score(st)
    if st.scheduled ~= score then
      if score == 0 then
        redis.call('ZADD', domains_key, '0', dom)
      elseif score == BLOCKED then
        redis.call('ZADD', domains_key, BLOCKED_S, dom)
      elseif score then
        redis.call('ZADD', domains_key, score, dom)
      else
        redis.call('ZREM', domains_key, dom)
      end
      st.scheduled = score
    end
  end
  pol.touched = {}
end

-- Lease up to n requests from domains that may be fetched now; returns a flat list lease key, score.
-- on_lease(m) takes a member out of the queue into a lease and returns its lease key, or returns false
-- when it refused the member (rejected it: it leaves the queue without taking a slot).
local function pol_lease(queue_key, domains_key, n, now, on_lease)
  local out, gone = {}, {}  -- gone: the members taken, out of the queue in one ZREM at the end
  local got = 0
  -- a due domain gives at least one request (a full one is scheduled BLOCKED, not due): n names suffice,
  -- a few more cover domains whose backlog was gone
  local ready = redis.call('ZRANGEBYSCORE', domains_key, '-inf', pol.now_s, 'WITHSCORES', 'LIMIT', '0',
                           decimal(math.min(256, n + 8)))
  for r = 1, #ready, 2 do
    if got >= n then break end
    local dom = ready[r]
    local st = pol_state(dom)
    st.scheduled = tonumber(ready[r + 1])  -- where it is, whatever its fields say
    local can = n - got
    if st.c > 0 then can = math.min(can, st.c - st.i) end
    if st.d > 0 then can = math.min(can, 1) end
    if can > 0 then
      local ms = redis.call('ZRANGEBYLEX', queue_key, '[' .. dom .. '\0', '(' .. dom .. '\1', 'LIMIT', '0',
                            decimal(can))
      if #ms == 0 then
        st.b = 0; st.w = true; pol.empty = true  -- heal a drifted counter rather than spin on it
      else
        local taken = 0
        for _, m in ipairs(ms) do
          gone[#gone + 1] = m
          local key = on_lease(m)
          if key then
            out[#out + 1] = key; out[#out + 1] = '0'
            got = got + 1
            taken = taken + 1
          end
        end
        pol_count(dom, -#ms, taken)
        if st.d > 0 and taken > 0 then pol_push_next(dom, now + st.d + pol_jitter(st.d, st.j)) end
      end
    end
    pol.touched[dom] = true
  end
  for i = 1, #gone, 7999 do redis.call('ZREM', queue_key, unpack(gone, i, math.min(i + 7998, #gone))) end
  return out
end
