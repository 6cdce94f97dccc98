-- Fragment: sync_check(state, sec) reads every value of Redis the sync call will build on, BEFORE its first
-- write (Redis does not roll a script back when it fails half way: a bloom bit set and then an error
-- would lose the request for good). A bad value is repaired here, or the call is refused as a whole.
-- Returns nil, or reason, detail for the {-2, reason, detail} answer (nothing written).
--   seq        the seq counter cannot be repaired (detail: the key)
-- Repairs: a key of the frontier holding another Redis type than the frontier ever writes there is not
-- ours: it is moved aside to <key>:garbage (RENAME, same hash slot; an older garbage copy is replaced, so
-- memory stays bounded) and the frontier goes on with the key empty, rather than stop every worker of
-- the crawl until someone deletes the key by hand; a seq counter that is not a decimal integer in
-- [0, 2^47) (or would pass 2^47 with this call) restarts past the largest seq found in a bounded sample of
-- the queue, leases and delayed ZSETs, plus 2^32 (state.repaired names it); a queue count (tails 'count')
-- that is not an integer is recounted; lease and delayed meta are checked where they are read
-- (sync_sweep); domain info in polite.lua (pol_state).
-- KEYS/ARGV: see sync_common.lua.

-- The seq of a queue member (0 if it has none we can read; values past SEQ_LIMIT are not ours).
local function member_seq(state, m)
  local six
  if state.polite then
    local z = string.find(m, '\0', 1, true)
    if not z or #m < z + 17 then return 0 end
    six = string.sub(m, z + 12, z + 17)
  else
    if #m < 6 then return 0 end
    six = string.sub(m, 1, 6)
  end
  local v = seq_value(six)
  if state.order == 'desc' then v = MAXSEQ - v end
  if v >= SEQ_LIMIT then return 0 end
  return v
end

local function largest_seq(state)
  local best = 0
  local function look(ms)
    for _, m in ipairs(ms) do
      local singles = chunk_singles(m, state.max_entry) or {m}
      for _, single in ipairs(singles) do best = math.max(best, member_seq(state, single)) end
    end
  end
  look(redis.call('ZRANGE', key_of.queue, 0, 15))
  look(redis.call('ZRANGE', key_of.queue, -16, -1))
  look(redis.call('ZRANGE', key_of.leases, -16, -1))
  look(redis.call('ZRANGE', key_of.delayed, -16, -1))
  return best
end

local function sync_check(state, sec)
  for _, name in ipairs(SYNC_KEYS) do type_ok(key_of[name], SYNC_TYPES[name], state.repaired) end
  local creates = sec.enqueue.n + sec.delay.n
  local raw = redis.call('GET', key_of.seq)
  local seq = raw and int_of(raw, SEQ_LIMIT) or (raw == false and 0) or nil
  if not seq or seq < 0 or seq + creates >= SEQ_LIMIT then
    local fresh = largest_seq(state) + 4294967296
    if fresh + creates >= SEQ_LIMIT then return 'seq', key_of.seq end
    redis.call('SET', key_of.seq, fresh)
    state.repaired[#state.repaired + 1] = key_of.seq
  end
  local count = redis.call('HGET', key_of.queue_tails, 'count')
  state.count0 = count and int_of(count, COUNTER_LIMIT) or (count == false and 0) or nil
  if state.count0 and state.count0 < 0 then state.count0 = nil end
  return nil
end
