-- Fragment (not a script on its own): crawl-wide politeness for sync.lua (SCHEDULER_POLITENESS = "cluster").
--
-- In this mode every queue member is  <domain> \0 <11-digit priority key> <6-byte seq> <payload>  with
-- score 0, so ZRANGEBYLEX over "<domain>\0" reads one domain's requests in priority-then-FIFO order
-- from the one queue ZSET.
-- The domains ZSET (KEYS[11]) is the schedule of hosts: every domain with queued requests is in it,
-- scored by when it may next be leased from (BLOCKED while all its slots are taken); a lease looks only
-- at the domains that are due, longest waiting first: a domain is due from the time it was queued, or
-- served last (it goes to the back), or its delay ran out -- never by its name, so none starves while
-- others keep arriving. Queuing a request costs no read of its domain: the call adds its domains
-- with ZADD NX at the call's time (one command per call; a domain already scheduled keeps its time). A domain
-- leaves the schedule when a lease finds it due and its range empty, or takes its last requests while
-- it is due; one with a next allowed time ahead or all slots taken stays scheduled even with nothing
-- queued, so that time is kept. A domain whose field says it is not due is not leased from whatever
-- the schedule says (an NX-added domain that is in fact waiting is scheduled again at its time).
-- Per domain, the info HASH (KEYS[12] of sync.lua) holds one field, read and written only by leases
-- and by the settling of leases:
--   p:<domain>  "<slots> <next>" or "<slots> <next> <delay> <concurrency> <jitter>"
-- slots: leased requests (concurrency slots in use); next: the next allowed lease time; then the
-- domain's limits, written only when they are not the calling worker's default ones (head
-- 'limits_default', a DOMAIN_LIMITS rule matched): as the last worker that enqueued one of its requests
-- with such limits wrote them. A field without limits takes the calling worker's default.
-- Layouts before: s:<domain> "<backlog> <slots> <next> <delay> <concurrency> <jitter>", and before it
-- four fields b:, i:, n:, l:<domain>. The field 'layout' = 'p' says the HASH holds neither: written when
-- a call finds the HASH absent (a crawl started by this version), with the field 'hashtable' (HASHTABLE):
-- its value is longer than hash-max-listpack-value (64 bytes by default), so Redis keeps the HASH a hash
-- table from the start (a HASH of fewer than 512 fields would be a listpack that every HGET and HSET
-- scans). In a HASH without the mark (a crawl
-- upgraded in place), a domain with no p: field is read from its older fields (pol_legacy: one HMGET
-- more, once per domain) and written back as p:, its older fields deleted; the older layouts kept every
-- domain with a backlog scheduled, so the schedule stays whole. Workers of two versions must not run at
-- the same time (an older worker counts in fields a newer one no longer reads): stop the older first.
-- Slots are leases: a dead worker's expire, and the sweep gives them back. The next allowed time moves
-- to (lease time + delay) on lease and to (finish time + delay) on acknowledgement, so two fetches of a
-- domain are at least `delay` apart even when a leased request waits in a worker's prefetch buffer.
--
-- A call reads a domain's field at most once (one HGET, checked: pol_state), keeps it in pol.st while it
-- leases and settles, writes every field that changed back in one HSET at its end, and moves a domain in
-- the schedule only when its place changes, each kind of move in one command (pol_flush).

local BLOCKED, BLOCKED_S = 1e15, '1e15'
local HASHTABLE =
  'this value is longer than 64 bytes so that Redis keeps this HASH a hash table, not a listpack'
-- st.scheduled of a domain the lease found due: at some score not after now (not read: Redis would print
-- each score with %.17g)
local DUE = 'due'
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
-- handed to redis.call is printed by Redis with %.17g, and string.format costs nearly as much. SMALL is
-- the reverse, filled as slot counts are read (tonumber runs strtod twice).
local DECIMAL, SMALL = {}, {}
-- FIELD0[v]: the slots of a field v = "<slots> 0" (a small count, no next time, no limits: what every
-- domain without a delay holds), filled as such fields are read: its parse and checks, done once
local FIELD0 = {}
local function decimal(x)
  local s = DECIMAL[x]
  if s then return s end
  s = string.format('%d', x)
  if x >= 0 and x < 4096 then DECIMAL[x] = s end
  return s
end
local function finite_in(s, lo, hi)
  local x = tonumber(s)
  if not x or x ~= x then return lo end
  return math.min(hi, math.max(lo, x))
end

-- What a worker's head 'limits_bound' gives, kept between calls (a FUNCTION library keeps it; an EVAL
-- script makes it anew): BOUNDS[limits_bound] = {max_delay, max_jitter, limits}, limits[s] the parse of
-- limits string s under those bounds (pol_parse_limits). Workers send a few short ones: a string longer
-- than KEPT_BYTES is not kept, and a table past its KEPT_BOUNDS or KEPT_LIMITS entries is dropped whole.
local BOUNDS, BOUNDS_N, KEPT_BOUNDS, KEPT_LIMITS, KEPT_BYTES = {}, 0, 16, 256, 128
local function pol_bounds(bound)
  local b = BOUNDS[bound]
  if b then
    if b.n >= KEPT_LIMITS then b.limits, b.n = {}, 0 end
    return b
  end
  b = {max_delay = MAX_DELAY, max_jitter = MAX_JITTER, limits = {}, n = 0}
  local bound_delay, bound_jitter = string.match(bound, '^(%S+) (%S+)$')
  if bound_delay then
    b.max_delay = finite_in(bound_delay, 0, MAX_DELAY)
    b.max_jitter = finite_in(bound_jitter, 0, MAX_JITTER)
  end
  if #bound <= KEPT_BYTES then
    if BOUNDS_N >= KEPT_BOUNDS then BOUNDS, BOUNDS_N = {}, 0 end
    BOUNDS[bound] = b
    BOUNDS_N = BOUNDS_N + 1
  end
  return b
end

-- pol.queue, pol.leases, pol.now (and now_s, as Redis writes it), pol.max_delay and pol.max_jitter (from
-- the calling worker's limits_bound: pol_bounds), pol.default (the calling worker's default limits
-- string, or nil): set by sync.lua (pol_reset) before the first call below. pol.st[dom]: the domain's
-- field as this call knows it; pol.touched[dom]: its place in the schedule is to be redone; pol.queued:
-- the ZADD NX arguments (now_s, domain; pol.nq of them) of the domains whose requests entered the queue
-- in this call, a domain once per request (Redis adds it once).
-- pol is the call's own: pol_reset() at the start of every call (a FUNCTION library keeps it between calls).
local pol
local function pol_reset(now, now_s, queue, leases, info, default, bound)
  if default == '' then default = nil end
  local b = pol_bounds(bound or '')
  pol = {st = {}, touched = {}, queued = {}, nq = 0, bounds = b, limits = b.limits, max_delay = b.max_delay,
         max_jitter = b.max_jitter, now = now, now_s = now_s, queue = queue, leases = leases, info = info,
         default = default}
end

-- a counter as written: an integer Redis can hold (|x| < 2^52), or nil
local function int_of52(s)
  local x = s and tonumber(s)
  if x and x == math.floor(x) and x > -4503599627370496 and x < 4503599627370496 then return x end
  return nil
end

-- Parse limits "delay concurrency jitter" into st, clamped into the bounds; a value past them is written
-- back clamped (pol.clamped makes sync.lua name the info HASH among the keys it repaired). No limits
-- (nil) are the calling worker's default (st.l stays nil: the field is written without limits), or none.
local function pol_parse_limits(st, l)
  st.l = l
  local src = l or pol.default
  if not src then st.d, st.c, st.j = 0, 0, 0; return end
  -- most domains share a few limit strings: parsed once (pol_bounds), a long one once per call (pol.own)
  local known = pol.limits[src] or pol.own and pol.own[src]
  if not known then
    local delay, conc, jitter = string.match(src, '^(%S+) (%S+) (%S+)$')
    local d, c, j = finite_in(delay, 0, pol.max_delay), math.floor(finite_in(conc, 0, 1e9)),
                    finite_in(jitter, 0, pol.max_jitter)
    local clean = d == tonumber(delay) and j == tonumber(jitter) and c == tonumber(conc)
    known = {d, c, j, not clean and string.format('%.17g %d %.17g', d, c, j)}
    if #src <= KEPT_BYTES then
      pol.limits[src] = known
      pol.bounds.n = pol.bounds.n + 1
    else
      pol.own = pol.own or {}
      pol.own[src] = known
    end
  end
  st.d, st.c, st.j = known[1], known[2], known[3]
  if known[4] and l then
    st.l = known[4]
    st.w = true
    pol.clamped = true
  end
end

-- Where the schedule puts a domain, from its field: BLOCKED (all its slots taken), else its next allowed
-- time (at least 0).
local function pol_score(st)
  if st.c > 0 and st.i >= st.c then return BLOCKED end
  if st.n > 0 then return st.n end
  return 0
end

-- A domain without a p: field in a HASH of an older layout: {slots, next, limits} from its s: field or
-- its four older fields (their b:/s: backlog is not kept: the schedule holds the domain), or nil.
local function pol_legacy(dom)
  if pol.layout == nil then
    -- once per call: a HASH marked, or none yet (then marked by pol_flush), holds no old fields
    pol.layout = redis.call('HGET', pol.info, 'layout') == 'p'
    if not pol.layout and redis.call('EXISTS', pol.info) == 0 then pol.layout, pol.mark = true, true end
  end
  if pol.layout then return nil end
  local v = redis.call('HMGET', pol.info, 's:' .. dom, 'i:' .. dom, 'n:' .. dom, 'l:' .. dom)
  if v[1] then
    local _, i, n, l = string.match(v[1], '^(%S+) (%S+) (%S+) (.*)$')
    if i then return {i, n, l} end
    return {'garbage', 'garbage'}
  end
  if v[2] or v[3] or v[4] then return {v[2], v[3], v[4]} end
  return nil
end

-- The domain's field, read once per call and validated before anything is written: slots an integer
-- Redis can hold (|x| < 2^52), not negative, and next a finite number no further ahead than the
-- domain's limits allow; garbage slots and next time are reset to 0 (slots in use past the leases there
-- are come down in pol_unstick); a field that is not of the layout is all garbage. st.w: st is to be
-- written back (pol_flush).
local function pol_state(dom)
  local st = pol.st[dom]
  if st then return st end
  local field = 'p:' .. dom
  local raw = redis.call('HGET', pol.info, field)
  local i0 = raw and FIELD0[raw]
  if i0 then
    st = {field = field, w = false, l = false, d = 0, c = 0, j = 0, i = i0, n = 0, n_s = '0',
          scheduled = false, emptied = false, served = false}
    pol.st[dom] = st
    pol_parse_limits(st, nil)
    return st
  end
  local vi, vn, vl
  local legacy
  if raw then
    vi, vn = string.match(raw, '^(%S+) (%S+)$')
    if not vi then
      vi, vn, vl = string.match(raw, '^(%S+) (%S+) (%S+ %S+ %S+)$')
      if not vi then vi, vn = 'garbage', 'garbage' end
    end
  else
    legacy = pol_legacy(dom)
    if legacy then vi, vn, vl = legacy[1], legacy[2], legacy[3] end
  end
  -- every field made by the constructor: a table grown field by field is reallocated three times
  st = {field = field, legacy = legacy, w = legacy ~= nil, l = false, d = 0, c = 0, j = 0, i = 0, n = 0,
        n_s = '0', scheduled = false, emptied = false, served = false}
  pol.st[dom] = st
  pol_parse_limits(st, vl)
  local i = SMALL[vi]
  if not i then
    i = int_of52(vi)
    if i and i >= 0 and i < 4096 and vi == decimal(i) then SMALL[vi] = i end
  end
  if vi and not (i and i >= 0) then i = 0; st.w = true end
  st.i = i or 0
  local n = vn and (vn == '0' and 0 or tonumber(vn))
  local wait = st.d * (1 + st.j)
  if wait < MAX_PENALTY then wait = MAX_PENALTY end
  local horizon = pol.now + wait + 1
  if vn and not (n and n == n and n > -1e15 and n <= horizon) then n = 0; vn = nil; st.w = true end
  st.n, st.n_s = n or 0, vn or '0'
  if raw and vn == '0' and not vl and SMALL[vi] then FIELD0[raw] = st.i end  -- checked, and clean
  return st
end

local function pol_domain(member)
  local z = string.find(member, '\0', 1, true)
  return z and string.sub(member, 1, z - 1)
end

-- A request of `dom` entered the queue: the domain is scheduled (ZADD NX at flush), its field not read.
local function pol_queued(dom)
  local n = pol.nq
  pol.queued[n + 1], pol.queued[n + 2] = pol.now_s, dom
  pol.nq = n + 2
end

-- A worker's limits for the domain, as it enqueues one of its requests: remembered when they are not its
-- default ones (the last such writer's hold).
local function pol_remember_limits(dom, limits)
  if limits == pol.default then return end
  local st = pol_state(dom)
  if st.l ~= limits then
    st.w = true
    pol_parse_limits(st, limits)
    pol.touched[dom] = true  -- a new concurrency can block or free it
  end
end

-- A request of `dom` entered the queue with the worker's `limits` for it: pol_queued inlined (one Lua call
-- less per enqueued request), then pol_remember_limits when they are not the worker's default.
local function pol_enqueued(dom, limits)
  local n = pol.nq
  pol.queued[n + 1], pol.queued[n + 2] = pol.now_s, dom
  pol.nq = n + 2
  if limits ~= pol.default then pol_remember_limits(dom, limits) end
end

-- Count a change of slots in use (di) for a domain; rescheduled in pol_flush when that blocks or frees it.
local function pol_slots(dom, di)
  local st = pol.st[dom] or pol_state(dom)
  local c = st.c  -- BLOCKED (pol_score) before and after
  local was = c > 0 and st.i >= c
  st.i = st.i + di
  st.w = true
  if was ~= (c > 0 and st.i >= c) then pol.touched[dom] = true end
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
  local st = pol.st[dom] or pol_state(dom)
  if st.d > 0 then pol_push_next(dom, now + st.d + pol_jitter(st.d, st.j)) end
end

-- A domain scheduled more than MAX_PENALTY ahead (BLOCKED included) is taken up again only when a call
-- touches it: one whose slots or score someone wrote garbage into would wait for ever. Each call that
-- checks (sync.lua) looks at one such domain, picked at random: slots in use past the leases there are
-- (garbage) come down to that count, and pol_flush schedules it again from its (checked) field.
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
  st.scheduled = nil  -- its score is not what its field says: written again
end

-- Write back what changed (one HSET for every changed field; a domain read from an older layout loses
-- its old fields), unless schedule_only (the flush before the lease: the fields wait for the call's end,
-- pol.st holds them meanwhile), and schedule every touched domain at its place -- removed when the lease
-- emptied it while due; written when its place is a wait (a next time ahead, or BLOCKED) even if nothing
-- of it is queued (the time is kept), else only if it is scheduled (ZADD XX); skipped when the lease found
-- it where it is to be (due, and to stay due); one ZREM, one ZADD XX and one ZADD for all -- then the
-- call's queued domains, in one ZADD NX at the call's time (last: a domain emptied and queued again in one
-- call stays scheduled).
local function pol_flush(domains_key, now, schedule_only)
  if pol.mark and not schedule_only then
    redis.call('HSET', pol.info, 'layout', 'p', 'hashtable', HASHTABLE); pol.mark = nil
  end
  local fields, nf = {}, 0  -- every changed field, written in one HSET
  for _, st in pairs(schedule_only and {} or pol.st) do
    if st.w then
      if not st.n_s then st.n_s = st.n == 0 and '0' or string.format('%.17g', st.n) end
      local v = decimal(st.i) .. ' ' .. st.n_s
      if st.l then v = v .. ' ' .. st.l end
      fields[nf + 1], fields[nf + 2] = st.field, v
      nf = nf + 2
      st.w = false
      if st.legacy then
        local dom = string.sub(st.field, 3)
        redis.call('HDEL', pol.info, 's:' .. dom, 'b:' .. dom, 'i:' .. dom, 'n:' .. dom, 'l:' .. dom)
        st.legacy = nil
      end
    end
  end
  for i = 1, nf, 7998 do redis.call('HSET', pol.info, unpack(fields, i, math.min(i + 7997, nf))) end
  -- the schedule's changes, one command each kind: removed, due again now (XX), a wait or BLOCKED
  local gone, ng, due, nd, wait, nw = {}, 0, {}, 0, {}, 0
  for dom, _ in pairs(pol.touched) do
    local st = pol.st[dom]
    local score = pol_score(st)
    if st.emptied and score ~= BLOCKED and st.n <= now then
      ng = ng + 1
      gone[ng] = dom
      st.scheduled = false
    elseif st.served and score <= now then
      due[nd + 1], due[nd + 2] = pol.now_s, dom
      nd = nd + 2
      st.scheduled = DUE
    elseif st.scheduled ~= score and not (st.scheduled == DUE and score <= now) then
      if score == BLOCKED or score > now then
        wait[nw + 1], wait[nw + 2] = score == BLOCKED and BLOCKED_S or score, dom
        nw = nw + 2
      else
        due[nd + 1], due[nd + 2] = pol.now_s, dom
        nd = nd + 2
      end
      st.scheduled = score
    end
    st.emptied, st.served = nil, nil
  end
  pol.touched = {}
  for i = 1, ng, 7999 do redis.call('ZREM', domains_key, unpack(gone, i, math.min(i + 7998, ng))) end
  for i = 1, nd, 7998 do redis.call('ZADD', domains_key, 'XX', unpack(due, i, math.min(i + 7997, nd))) end
  for i = 1, nw, 7998 do redis.call('ZADD', domains_key, unpack(wait, i, math.min(i + 7997, nw))) end
  local queued, nq = pol.queued, pol.nq
  pol.queued, pol.nq = {}, 0
  for i = 1, nq, 7998 do redis.call('ZADD', domains_key, 'NX', unpack(queued, i, math.min(i + 7997, nq))) end
end

-- Lease up to n requests from domains that may be fetched now; returns a flat list lease key, score.
-- on_lease(m) takes a member out of the queue into a lease and returns its lease key, or returns false
-- when it refused the member (rejected it: it leaves the queue without taking a slot).
local function pol_lease(queue_key, domains_key, n, now, on_lease)
  local out, gone = {}, {}  -- gone: the members taken, out of the queue in one ZREM at the end
  local got = 0
  -- a due domain gives at least one request (a full one is scheduled BLOCKED, not due): n names suffice,
  -- a few more cover domains whose range was empty
  local ready = redis.call('ZRANGEBYSCORE', domains_key, '-inf', pol.now_s, 'LIMIT', '0',
                           decimal(math.min(256, n + 8)))
  for _, dom in ipairs(ready) do
    if got >= n then break end
    local st = pol_state(dom)
    st.scheduled = DUE  -- where it is, whatever its field says
    local can = n - got
    if st.c > 0 then can = math.min(can, st.c - st.i) end
    if st.d > 0 then can = math.min(can, 1) end
    if st.n > now then can = 0 end  -- not due by its field (added at 0 while waiting): rescheduled
    if can > 0 then
      local ms = redis.call('ZRANGEBYLEX', queue_key, '[' .. dom .. '\0', '(' .. dom .. '\1', 'LIMIT', '0',
                            decimal(can))
      if #ms > 0 then
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
        if taken > 0 then
          st.i = st.i + taken
          st.w = true
          st.served = true
        end
        if st.d > 0 and taken > 0 then pol_push_next(dom, now + st.d + pol_jitter(st.d, st.j)) end
      end
      st.emptied = #ms < can
    end
    pol.touched[dom] = true
  end
  for i = 1, #gone, 7999 do redis.call('ZREM', queue_key, unpack(gone, i, math.min(i + 7998, #gone))) end
  return out
end
