-- Fragment: step 11 of a sync call (KEYS/ARGV: see sync_common.lua).
-- sync_lease(state) leases up to state.n_lease requests (none while the control HASH says paused = '1') and
-- returns the flat list lease key, score, lease key, score... (lease keys: sync_sweep.lua). A queue member
-- that is not a well-formed single or chunk (chunk_singles: too many records, truncated, larger than
-- max_entry_bytes) is removed and rejected whole by the script itself, as ONE record of bounded size (its
-- first 64 bytes in hex), so hostile members cost bounded work (state.rejected counts them). So is a copy of
-- an entry already handed out (its nonce is in KEYS spent: claim in sync_common.lua), reason 'replayed'.

local function sync_reject_member(state, member, reason)
  state.rejected = state.rejected + 1
  if reason == 'replayed' then state.replayed = state.replayed + 1 end
  push_capped(key_of.queue_rejected, cjson.encode({
    reason = reason, detail = 'queue member rejected whole by the sync script',
    raw = hex_head(member, 64), raw_encoding = 'hex', raw_bytes = #member, at = state.now, worker = state.worker,
  }), state.rejected_maxlen)
end

-- With crawl-wide politeness (polite.lua) every queue member has score 0 -- ZRANGEBYLEX reads a domain's
-- requests, and is only defined over members of one score -- and belongs to a domain that is scheduled
-- while it has a backlog. What someone else writes there must not hide the frontier from every worker (one
-- member of another score makes every domain's range read empty) nor keep a crawl from finishing. So a
-- call that checks (sync.lua: one in four, and every call whose lease came up short) does, bounded: up to
-- 64 members of another score on each side of 0 go back to score 0 (ours whose score was changed keep their
-- place; anything else is rejected when leased), and 4 random members are looked at: one with no domain
-- part is rejected whole; one whose domain is missing from the domains ZSET gets it scheduled again, so it is
-- leased, and decoded or rejected by a worker.
local POLITE_FOREIGN_SCORES = {{'-inf', '(0'}, {'(0', '+inf'}}

local function sync_polite_queue(state)
  for _, range in ipairs(POLITE_FOREIGN_SCORES) do
    for _, m in ipairs(redis.call('ZRANGEBYSCORE', key_of.queue, range[1], range[2], 'LIMIT', '0', '64')) do
      redis.call('ZADD', key_of.queue, 0, m)
    end
  end
  for _, m in ipairs(redis.call('ZRANDMEMBER', key_of.queue, '4')) do
    local dom = pol_domain(m)
    if not dom then
      redis.call('ZREM', key_of.queue, m)
      state.queued_delta = state.queued_delta - 1
      sync_reject_member(state, m, 'no_domain')
    elseif not redis.call('ZSCORE', key_of.domains, dom) then
      pol_queued(dom)  -- queued but not scheduled (someone removed it): scheduled again
    end
  end
end

-- m leaves the queue into a lease; returns its lease key
local function sync_take(state, m, score)
  local L = lease_key(state, m, score)
  redis.call('ZADD', key_of.leases, state.deadline, L)
  return L
end

local function sync_lease(state)
  local leased = {}
  local n_lease = state.n_lease
  if state.paused == '1' then n_lease = 0 end
  if n_lease <= 0 then return leased end
  if state.polite then
    pol_flush(key_of.domains, state.now, true)
    -- a member is <domain>\0<11-digit priority key><seq><payload>: bound it like a single (+ its domain)
    local limit = state.max_entry + 6 + 12 + 1024
    return pol_lease(key_of.queue, key_of.domains, n_lease, state.now, function(m)
      if #m > limit or not claim(state, m) then
        state.queued_delta = state.queued_delta - 1
        sync_reject_member(state, m, #m > limit and 'entry_too_large' or 'replayed')
        return false
      end
      return sync_take(state, m, '0')
    end)
  end
  local got, tries = 0, 0
  while got < n_lease and tries < n_lease + 64 do
    tries = tries + 1
    local popped = redis.call('ZPOPMIN', key_of.queue, 1)
    if #popped == 0 then break end
    local member, score = popped[1], popped[2]
    local singles, why = chunk_singles(member, state.max_entry)
    if not singles then
      state.queued_delta = state.queued_delta - 1
      if redis.call('HGET', key_of.queue_tails, score) == member then redis.call('HDEL', key_of.queue_tails, score) end
      sync_reject_member(state, member, why)
    else
      local keep = math.min(#singles, n_lease - got)
      for i = 1, keep do
        if not claim(state, singles[i]) then
          state.queued_delta = state.queued_delta - 1
          sync_reject_member(state, singles[i], 'replayed')
        else
          leased[#leased + 1] = sync_take(state, singles[i], score); leased[#leased + 1] = score
          got = got + 1
        end
      end
      if keep < #singles then
        -- the rest goes back as a chunk headed by its first record's seq (same place in the order)
        local rest = {}
        for i = keep + 1, #singles do rest[#rest + 1] = u16(#singles[i] - 6) .. singles[i] end
        local left = string.sub(singles[keep + 1], 1, 6) .. '\0' .. table.concat(rest)
        redis.call('ZADD', key_of.queue, score, left)
        if redis.call('HGET', key_of.queue_tails, score) == member then redis.call('HSET', key_of.queue_tails, score, left) end
      end
    end
  end
  return leased
end
