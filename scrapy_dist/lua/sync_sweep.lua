-- Fragment: steps 1-2 of a sync call (KEYS/ARGV: see sync_common.lua).
-- sync_sweep(S): leases of dead workers that ran out go back to the queue with their original score, and
-- delayed retries that are due join the queue; at most 500 of each per call (bounded work). A score read
-- from lease or delayed meta that is not a finite number is replaced by 0 (the request is kept).
-- Sets S.requeued, S.moved.

-- member layout: seq .. payload, or with politeness domain \0 priority-key seq payload (score 0)
local function member_of(S, seq, score, payload, dom)
  if not S.polite then return seq .. payload, score end
  return dom .. '\0' .. string.format('%011d', tonumber(score) + 2147483648) .. seq .. payload, 0
end

-- a member goes (back) into the queue
local function to_queue(S, m, score)
  redis.call('ZADD', K.queue, score, m)
  S.queued_delta = S.queued_delta + 1
  if S.polite then
    local dom = pol_domain(m)
    if dom then pol_count(K.domain_info, dom, 1, 0) end
  end
end

-- a member stops being leased (ack, release, expiry, rejection): 1 if it was leased
local function unlease(S, m)
  local was = redis.call('ZREM', K.leases, m)
  redis.call('HDEL', K.lease_meta, m)
  if was == 1 and S.polite then
    local dom = pol_domain(m)
    if dom then pol_count(K.domain_info, dom, 0, -1) end
  end
  return was
end

local function lease_score(m)
  local meta = redis.call('HGET', K.lease_meta, m)
  local s = meta and string.match(meta, '^(%S+)')
  if s and score_of(s) then return s end
  return '0'
end

local function sync_sweep(S)
  S.requeued = 0
  local expired = redis.call('ZRANGEBYSCORE', K.leases, '-inf', S.now, 'LIMIT', 0, 500)
  for _, m in ipairs(expired) do
    local score = lease_score(m)
    unlease(S, m)
    to_queue(S, m, score)
    S.requeued = S.requeued + 1
  end
  S.moved = 0
  local due = redis.call('ZRANGEBYSCORE', K.delayed, '-inf', S.now, 'LIMIT', 0, 500)
  local revisits = 0
  for _, m in ipairs(due) do
    local meta = redis.call('HGET', K.delayed_meta, m)
    -- "<score>" for a retry, "<score> r" for a revisit (sync_revisit)
    local score, tag = nil, nil
    if meta then score, tag = string.match(meta, '^(%S+)( ?r?)$') end
    if tag == ' r' then revisits = revisits + 1 end
    if not (score and score_of(score)) then score = '0' end
    redis.call('ZREM', K.delayed, m)
    redis.call('HDEL', K.delayed_meta, m)
    to_queue(S, m, score)
    S.moved = S.moved + 1
  end
  if revisits > 0 then
    local left = int_of(redis.call('HGET', K.delayed_meta, 'revisits'), COUNTER_LIMIT) or 0
    redis.call('HSET', K.delayed_meta, 'revisits', math.max(0, left - revisits))
  end
end
