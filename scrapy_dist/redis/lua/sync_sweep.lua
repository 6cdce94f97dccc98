-- Fragment: steps 1-2 of a sync call (KEYS/ARGV: see sync_common.lua), and what a lease is.
-- sync_sweep(state): leases of dead workers that ran out go back to the queue with their original score, and
-- delayed retries that are due join the queue; at most 500 of each per call (bounded work). A score read
-- from a lease's tag or delayed meta that is not a finite number is replaced by 0 (the request is kept).
-- Sets state.requeued, state.moved.
--
-- Lease keys. A leased request is filed in the leases ZSET (score: its deadline) under a *lease key*: its
-- queue member followed by a tag naming the queue score it goes back with and the worker holding it,
--   <member> \0 \255 <score> ' ' <worker id> <2-byte length of "<score> <worker id>">
-- The worker gets the lease key (sync_lease answers it) and settles the lease by it, so a lease costs one
-- ZADD and an ack one ZREM. A key without a well-formed tag (its score and worker then in the lease meta
-- HASH, or anything someone else wrote there) is its own member, with the score its meta names, or 0:
-- read as untrusted, it never fails a call.

-- member layout: seq .. payload, or with politeness domain \0 priority-key seq payload (score 0)
local function member_of(state, seq, score, payload, dom)
  if not state.polite then return seq .. payload, score end
  -- the priority key has 11 digits: a score outside a 32-bit priority's range is clamped to its ends
  -- (made once per score and call: a call's requests share a few)
  local key = state.priority_keys[score]
  if not key then
    key = string.format('%011d', math.max(0, math.min(tonumber(score) + 2147483648, 4294967295)))
    state.priority_keys[score] = key
  end
  return dom .. '\0' .. key .. seq .. payload, '0'
end

-- a member goes (back) into the queue; with politeness at score 0 whatever a tag or meta says (a member
-- of another score would break every domain's ZRANGEBYLEX: see sync_polite_queue)
local function to_queue(state, m, score)
  if state.polite then score = '0' end
  redis.call('ZADD', key_of.queue, score, m)
  state.queued_delta = state.queued_delta + 1
  if state.polite then
    local dom = pol_domain(m)
    if dom then pol_queued(dom) end
  end
end

local LEASE_MARK = '\0\255'  -- lease_tag_at tests its two bytes
-- a tag longer than this (a worker id of kilobytes) is not written: such a lease uses the meta HASH
local LEASE_TAG_MAX = 4096

-- The lease key of member m leased now at queue score `score` (a string) by this call's worker. A
-- call's leases share a few scores: each score's tag is built once per call (state.tags).
local function lease_key(state, m, score)
  local tail = state.tags[score]
  if tail == nil then
    local tag = score .. ' ' .. state.worker
    tail = #tag <= LEASE_TAG_MAX and LEASE_MARK .. tag .. u16(#tag)
    state.tags[score] = tail
  end
  if not tail then
    redis.call('HSET', key_of.lease_meta, m, score .. ' ' .. state.worker)
    return m
  end
  return m .. tail
end

-- Where the tag of lease key L starts (the index of its mark), or nil: L has no well-formed tag.
local function lease_tag_at(L)
  local size = #L
  if size < 6 then return nil end
  local byte = string.byte
  local at = size - 3 - (byte(L, size - 1) * 256 + byte(L, size))
  if at < 2 or byte(L, at) ~= 0 or byte(L, at + 1) ~= 255 then return nil end
  return at
end

-- The queue member of lease key L.
local function lease_member(L)
  local at = lease_tag_at(L)
  if not at then return L end
  return string.sub(L, 1, at - 1)
end

-- The queue member of lease key L and the score it goes back to the queue with ('0' if none is known).
local function lease_entry(L)
  local at = lease_tag_at(L)
  local m, s = L, nil
  if at then
    m = string.sub(L, 1, at - 1)
    s = string.match(string.sub(L, at + 2, -3), '^(%S+) ')
  else
    local meta = redis.call('HGET', key_of.lease_meta, L)
    s = meta and string.match(meta, '^(%S+)')
  end
  if s and score_of(s) then return m, s end
  return m, '0'
end

-- a lease key stops being leased (ack, release, expiry, rejection): 1 if it was leased, and with
-- politeness its domain (whose slot it frees)
local function unlease(state, L)
  local was = redis.call('ZREM', key_of.leases, L)
  if not lease_tag_at(L) then redis.call('HDEL', key_of.lease_meta, L) end
  if was == 1 and state.polite then
    local dom = pol_domain(L)
    if dom then pol_slots(dom, -1) end
    return was, dom
  end
  return was
end

local function sync_sweep(state)
  state.requeued = 0
  local expired = redis.call('ZRANGEBYSCORE', key_of.leases, '-inf', state.now_s, 'LIMIT', '0', '500')
  for _, L in ipairs(expired) do
    local m, score = lease_entry(L)
    unlease(state, L)
    to_queue(state, m, score)
    unremember(state, m)  -- not finished: its next lease is not a replay
    state.requeued = state.requeued + 1
  end
  state.moved = 0
  local due = redis.call('ZRANGEBYSCORE', key_of.delayed, '-inf', state.now_s, 'LIMIT', '0', '500')
  local revisits = 0
  for _, m in ipairs(due) do
    local meta = redis.call('HGET', key_of.delayed_meta, m)
    -- "<score>" for a retry, "<score> r" for a revisit (sync_revisit)
    local score, tag = nil, nil
    if meta then score, tag = string.match(meta, '^(%S+)( ?r?)$') end
    if tag == ' r' then revisits = revisits + 1 end
    if not (score and score_of(score)) then score = '0' end
    redis.call('ZREM', key_of.delayed, m)
    redis.call('HDEL', key_of.delayed_meta, m)
    to_queue(state, m, score)
    state.moved = state.moved + 1
  end
  if revisits > 0 then
    local left = int_of(redis.call('HGET', key_of.delayed_meta, 'revisits'), COUNTER_LIMIT) or 0
    redis.call('HSET', key_of.delayed_meta, 'revisits', math.max(0, left - revisits))
  end
end
