-- Fragment: steps 4-6 and 8-10 of a sync call (KEYS/ARGV: see sync_common.lua): what the worker settles
-- about the leases it holds. Each function takes its section {pos, n, w} (sync_sections).
--   sync_ack       the work is done and its output is in (sync_enqueue, same call)
--   sync_renew     lease renewals (only leases still held: one that already ran out stays requeued)
--   sync_release   unstarted work given back on shutdown (back to the queue with its original score)
--   sync_reject    rejected entries leave the lease set for the rejected LIST (capped: rejected_maxlen)
--   sync_dead      dead letters (the deadletter LIST, capped: dead_maxlen)
--   sync_penalize  domains told to slow down (429/503, Retry-After), with crawl-wide politeness
--   sync_revisit   an ack that also files the request again in the delayed set (revisits)
--   sync_forget    fingerprints made new again (DEADLETTER_FORGET: a dead-lettered request's, in the same
--                  call as its dead letter), dupe.lua's dupe_forget

-- The items of a section, `width` ARGV values each: `for m, x in items(sec, 2) do ... end`.
local function items(sec, width)
  local i, pos = 0, sec.pos
  return function()
    if i >= sec.n then return nil end
    i = i + 1
    pos = pos + width
    return ARGV[pos - width], ARGV[pos - width + 1]
  end
end

-- lease key L's lease is over (1 if it was leased): with politeness, its domain has one slot free again
local function lease_done(state, L)
  local found, dom = unlease(state, L)
  if dom then pol_finished(dom, state.now) end
  return found
end

-- m was taken out of the queue: one less queued (with politeness its domain leaves the schedule when a
-- lease finds nothing of it queued)
local function dequeued(state)
  state.queued_delta = state.queued_delta - 1
end

local function sync_ack(state, sec)
  for L in items(sec, 1) do
    -- a lease that ran out was moved back to the queue (sync_sweep): that copy need not run again. A
    -- lease still held has no copy there, which saves the ZREM (one command per page).
    local ok = lease_done(state, L) == 1
    if not ok then
      local m = lease_member(L)
      if redis.call('ZREM', key_of.queue, m) == 1 then
        dequeued(state)
        ok = true
      end
      remember(state, m)  -- the sweep forgot it when it requeued it
    end
    items_acked(state, L, ok)
  end
end

local function sync_renew(state, sec)
  for L in items(sec, 1) do redis.call('ZADD', key_of.leases, 'XX', state.deadline, L) end
end

local function sync_release(state, sec)
  for L in items(sec, 1) do
    local m, score = lease_entry(L)
    if unlease(state, L) == 1 then
      to_queue(state, m, score)
      unremember(state, m)
    end
  end
end

local function sync_reject(state, sec)
  for L, record in items(sec, 2) do
    unlease(state, L)
    push_capped(key_of.queue_rejected, record, state.rejected_maxlen)
  end
end

local function sync_dead(state, sec)
  local pos = sec.pos
  for i = 1, sec.n do
    push_capped(key_of.deadletter, ARGV[pos], state.dead_maxlen); pos = pos + 1
  end
end

local function sync_forget(d, sec)
  for t1, t2 in items(sec, 2) do dupe_forget(d, t1, t2) end
end

local function sync_penalize(state, sec)
  if not state.polite then return end
  local pos = sec.pos
  for i = 1, sec.n do
    local seconds = score_of(ARGV[pos + 1])
    if seconds then pol_push_next(ARGV[pos], state.now + seconds) end
    pos = pos + 2
  end
end

-- A revisit is an ack (as sync_ack) that also files the request in the delayed set, due `delay` seconds
-- from now, as `new` (the same entry with updated conditional headers; '' = the member unchanged), in
-- the same atomic call: a worker killed before it lands leaves the lease to run out and the page to be
-- fetched again, never lost, never copied. Only a member still leased, queued or delayed is filed
-- again: a second ack of the same lease (two workers held it one after the other) finds it gone and
-- adds nothing. Delayed meta is "<queue score> r" (the tag counts scheduled revisits: delayed_meta
-- field 'revisits', decremented by sync_sweep when one comes due).
-- the count of scheduled revisits (delayed meta field 'revisits'), read as untrusted: garbage restarts at 0
local function revisits_add(n)
  local left = int_of(redis.call('HGET', key_of.delayed_meta, 'revisits'), COUNTER_LIMIT) or 0
  redis.call('HSET', key_of.delayed_meta, 'revisits', math.max(0, left + n))
end

local function sync_revisit(state, sec)
  local pos = sec.pos
  for i = 1, sec.n do
    local L, delay, new = ARGV[pos], score_of(ARGV[pos + 1]), ARGV[pos + 2]
    pos = pos + sec.w
    local m, score = lease_entry(L)
    local found = lease_done(state, L)
    local qs = redis.call('ZSCORE', key_of.queue, m)
    if qs and redis.call('ZREM', key_of.queue, m) == 1 then
      found = 1
      score = qs
      dequeued(state)
    end
    items_acked(state, L, found == 1)
    if redis.call('ZREM', key_of.delayed, m) == 1 then
      found = 1
      local meta = redis.call('HGET', key_of.delayed_meta, m)
      local s = meta and string.match(meta, '^(%S+)')
      if s and score_of(s) then score = s end
      redis.call('HDEL', key_of.delayed_meta, m)
      if meta and string.match(meta, ' r$') then revisits_add(-1) end
    end
    if found == 1 and delay and delay >= 0 then
      if new == '' then new = m end
      if redis.call('ZADD', key_of.delayed, state.now + delay, new) == 1 then
        revisits_add(1)
      end
      redis.call('HSET', key_of.delayed_meta, new, score .. ' r')
    end
  end
end
