-- Fragment: steps 4-6 and 8-10 of a sync call (KEYS/ARGV: see sync_common.lua): what the worker settles
-- about the leases it holds. Each function takes its section {pos, n, w} (sync_sections).
--   sync_ack       the work is done and its output is in (sync_enqueue, same call)
--   sync_renew     lease renewals (only leases still held: one that already ran out stays requeued)
--   sync_release   unstarted work given back on shutdown (back to the queue with its original score)
--   sync_reject    rejected entries leave the lease set for the rejected LIST (capped: rejected_maxlen)
--   sync_dead      dead letters (the deadletter LIST, capped: dead_maxlen)
--   sync_penalize  domains told to slow down (429/503, Retry-After), with crawl-wide politeness

local function sync_ack(S, sec)
  local pos = sec.pos
  for i = 1, sec.n do
    local m = ARGV[pos]; pos = pos + 1
    if unlease(S, m) == 1 and S.polite then
      local dom = pol_domain(m)
      if dom then pol_finished(K.domain_info, dom, S.now) end
    end
    -- a copy requeued after its lease ran out need not run again
    if redis.call('ZREM', K.queue, m) == 1 then
      S.queued_delta = S.queued_delta - 1
      if S.polite then
        local dom = pol_domain(m)
        if dom then pol_count(K.domain_info, dom, -1, 0) end
      end
    end
  end
end

local function sync_renew(S, sec)
  local pos = sec.pos
  for i = 1, sec.n do
    redis.call('ZADD', K.leases, 'XX', S.deadline, ARGV[pos]); pos = pos + 1
  end
end

local function sync_release(S, sec)
  local pos = sec.pos
  for i = 1, sec.n do
    local m = ARGV[pos]; pos = pos + 1
    local score = lease_score(m)
    if unlease(S, m) == 1 then to_queue(S, m, score) end
  end
end

local function sync_reject(S, sec)
  local pos = sec.pos
  for i = 1, sec.n do
    local m, record = ARGV[pos], ARGV[pos + 1]; pos = pos + 2
    unlease(S, m)
    push_capped(K.rejected, record, S.rejected_maxlen)
  end
end

local function sync_dead(S, sec)
  local pos = sec.pos
  for i = 1, sec.n do
    push_capped(K.deadletter, ARGV[pos], S.dead_maxlen); pos = pos + 1
  end
end

local function sync_penalize(S, sec)
  if not S.polite then return end
  local pos = sec.pos
  for i = 1, sec.n do
    local seconds = score_of(ARGV[pos + 1])
    if seconds then pol_push_next(K.domain_info, ARGV[pos], S.now + seconds) end
    pos = pos + 2
  end
end
