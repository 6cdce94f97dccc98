-- sync: one worker's whole exchange with the frontier in one atomic call.
-- Requeues expired leases, moves due delayed retries into the queue, dedupes and enqueues discovered
-- requests, acknowledges finished ones, renews/releases/rejects leases, writes dead letters and leases
-- new work -- so a batch's new requests and the ack of the request that produced them land together.
--
-- KEYS[1] queue ZSET          KEYS[2] leases ZSET        KEYS[3] lease meta HASH   KEYS[4] seq STRING
-- KEYS[5] delayed ZSET        KEYS[6] delayed meta HASH  KEYS[7] rejected LIST     KEYS[8] deadletter LIST
-- KEYS[9] workers ZSET        KEYS[10] control HASH      KEYS[11] domains ZSET     KEYS[12] domain info HASH
-- KEYS[13..] dupefilter keys (see dupe.lua)
-- ARGV[1] now (unix seconds; '' = server time)   ARGV[2] worker id ('' = a tool, not a worker)
-- ARGV[3] lease seconds   ARGV[4] how many requests to lease
-- ARGV[5] 'asc' (FIFO/priority) or 'desc' (LIFO)   ARGV[6] politeness: 'process' or 'cluster' (polite.lua)
-- ARGV[7] random seed (politeness jitter)   ARGV[8] dupe mode   ARGV[9] P   ARGV[10 .. 9+P] dupe params
-- then sections, each a count followed by its items (W = 4, or 6 with politeness):
--   enqueue: W per item: t1, t2 (t1 == '' skips dedupe), score, payload (payload == '' dedupes only)
--            [, domain, limits "delay concurrency jitter"]
--   ack:     1 per item: member
--   renew:   1 per item: member
--   release: 1 per item: member            (back to the queue with its original score, now)
--   delay:   W-1 per item: score, payload, delay in seconds from now (the server's clock decides)
--            [, domain, limits]
--   reject:  2 per item: member, JSON record (the leased member is dropped, the record pushed)
--   dead:    1 per item: JSON record
--   penalize: 2 per item: domain, seconds (429/503: the domain's next allowed time moves back)
-- Returns {flags, leased, requeued, moved, queued, inflight, delayed, bloom_n, paused} where flags has one
-- '1'/'0' per enqueue item (new/duplicate) and leased is a flat list member, score, member, score...
-- Returns {-1, bloom_n} (nothing written) when the bloom filter needs keys for more filters.

local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local worker = ARGV[2]
local lease_s = tonumber(ARGV[3])
local n_lease = tonumber(ARGV[4])
local order = ARGV[5]
local polite = ARGV[6] == 'cluster'
math.randomseed(tonumber(ARGV[7]) or 0)
local P = tonumber(ARGV[9])
local params = {}
for i = 1, P do params[i] = ARGV[9 + i] end
local pos = 10 + P
local W = polite and 6 or 4
local Q, L, LM, DOMS, INFO = KEYS[1], KEYS[2], KEYS[3], KEYS[11], KEYS[12]

local d = dupe_open(ARGV[8], 13, params)
local n_enqueue = tonumber(ARGV[pos])
if not dupe_can_insert(d, n_enqueue) then return {-1, d.n} end

local function seq6(s)
  local b = {}
  for i = 6, 1, -1 do b[i] = s % 256; s = math.floor(s / 256) end
  return string.char(b[1], b[2], b[3], b[4], b[5], b[6])
end
local MAXSEQ = 281474976710655  -- 2^48 - 1
local function new_seqs(count)
  local last = redis.call('INCRBY', KEYS[4], count)
  local first = last - count + 1
  local out = {}
  for i = 0, count - 1 do
    local s = first + i
    if order == 'desc' then s = MAXSEQ - s end
    out[i + 1] = seq6(s)
  end
  return out
end
-- member layout: seq .. payload, or with politeness domain \0 priority-key seq payload (score 0)
local function member_of(seq, score, payload, dom)
  if not polite then return seq .. payload, score end
  return dom .. '\0' .. string.format('%011d', tonumber(score) + 2147483648) .. seq .. payload, 0
end
local function remember_limits(dom, limits)
  redis.call('HSET', INFO, 'l:' .. dom, limits)
end
-- a member goes (back) into the queue
local function to_queue(m, score)
  redis.call('ZADD', Q, score, m)
  if polite then pol_count(INFO, pol_domain(m), 1, 0) end
end
-- a member stops being leased (ack, release, expiry, rejection): 1 if it was leased
local function unlease(m)
  local was = redis.call('ZREM', L, m)
  redis.call('HDEL', LM, m)
  if was == 1 and polite then pol_count(INFO, pol_domain(m), 0, -1) end
  return was
end
local function lease_score(m)
  local meta = redis.call('HGET', LM, m)
  return meta and string.match(meta, '^(%S+)') or '0'
end

-- 1. leases of dead workers run out: back to the queue with their original priority
local requeued = 0
local expired = redis.call('ZRANGEBYSCORE', L, '-inf', now, 'LIMIT', 0, 500)
for _, m in ipairs(expired) do
  local score = lease_score(m)
  unlease(m)
  to_queue(m, score)
  requeued = requeued + 1
end

-- 2. due delayed retries join the queue
local moved = 0
local due = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, 500)
for _, m in ipairs(due) do
  local score = redis.call('HGET', KEYS[6], m) or '0'
  redis.call('ZREM', KEYS[5], m)
  redis.call('HDEL', KEYS[6], m)
  to_queue(m, score)
  moved = moved + 1
end

-- 3. discovered requests: dedupe, then enqueue the new ones
local flags = {}
local to_add = {}
pos = pos + 1
for i = 1, n_enqueue do
  local t1, payload = ARGV[pos], ARGV[pos + 3]
  local new = 1
  if t1 ~= '' then new = dupe_add(d, t1, ARGV[pos + 1]) end
  flags[i] = new
  if new == 1 and payload ~= '' then to_add[#to_add + 1] = pos end
  pos = pos + W
end
if #to_add > 0 then
  local seqs = new_seqs(#to_add)
  local args = {}
  for i, p in ipairs(to_add) do
    local m, score = member_of(seqs[i], ARGV[p + 2], ARGV[p + 3], ARGV[p + 4])
    args[#args + 1] = score; args[#args + 1] = m
    if polite then
      remember_limits(ARGV[p + 4], ARGV[p + 5])
      pol_count(INFO, ARGV[p + 4], 1, 0)
    end
  end
  for i = 1, #args, 7998 do
    redis.call('ZADD', Q, unpack(args, i, math.min(i + 7997, #args)))
  end
end

-- 4. acknowledgements: the work is done and its output is in (step 3, same call)
local n = tonumber(ARGV[pos]); pos = pos + 1
for i = 1, n do
  local m = ARGV[pos]; pos = pos + 1
  if unlease(m) == 1 and polite then pol_finished(INFO, pol_domain(m), now) end
  -- a copy requeued after its lease ran out need not run again
  if redis.call('ZREM', Q, m) == 1 and polite then pol_count(INFO, pol_domain(m), -1, 0) end
end

-- 5. lease renewals (only leases still held: a lease that already ran out stays requeued)
local deadline = now + lease_s
n = tonumber(ARGV[pos]); pos = pos + 1
for i = 1, n do
  redis.call('ZADD', L, 'XX', deadline, ARGV[pos]); pos = pos + 1
end

-- 6. releases: unstarted work given back on shutdown
n = tonumber(ARGV[pos]); pos = pos + 1
for i = 1, n do
  local m = ARGV[pos]; pos = pos + 1
  local score = lease_score(m)
  if unlease(m) == 1 then to_queue(m, score) end
end

-- 7. delayed retries
n = tonumber(ARGV[pos]); pos = pos + 1
if n > 0 then
  local seqs = new_seqs(n)
  for i = 1, n do
    local score, payload, delay = ARGV[pos], ARGV[pos + 1], tonumber(ARGV[pos + 2])
    local m, qscore = member_of(seqs[i], score, payload, ARGV[pos + 3])
    if polite then remember_limits(ARGV[pos + 3], ARGV[pos + 4]) end
    redis.call('ZADD', KEYS[5], now + delay, m)
    redis.call('HSET', KEYS[6], m, qscore)
    pos = pos + W - 1
  end
end

-- 8. rejected entries leave the lease set for the rejected list
n = tonumber(ARGV[pos]); pos = pos + 1
for i = 1, n do
  local m, record = ARGV[pos], ARGV[pos + 1]; pos = pos + 2
  unlease(m)
  redis.call('RPUSH', KEYS[7], record)
end

-- 9. dead letters
n = tonumber(ARGV[pos]); pos = pos + 1
for i = 1, n do
  redis.call('RPUSH', KEYS[8], ARGV[pos]); pos = pos + 1
end

-- 10. domains told to slow down (429/503, Retry-After)
n = tonumber(ARGV[pos]); pos = pos + 1
for i = 1, n do
  if polite then pol_push_next(INFO, ARGV[pos], now + tonumber(ARGV[pos + 1])) end
  pos = pos + 2
end

-- 11. lease new work
local leased = {}
local paused = redis.call('HGET', KEYS[10], 'paused')
if paused == '1' then n_lease = 0 else paused = '0' end
local function take(m, score)
  redis.call('ZADD', L, deadline, m)
  redis.call('HSET', LM, m, score .. ' ' .. worker)
end
if n_lease > 0 then
  if polite then
    pol_flush(DOMS, INFO, now)
    leased = pol_lease(Q, DOMS, INFO, n_lease, now, function(m) take(m, '0') end)
  else
    local popped = redis.call('ZPOPMIN', Q, n_lease)
    for i = 1, #popped, 2 do
      take(popped[i], popped[i + 1])
      leased[#leased + 1] = popped[i]; leased[#leased + 1] = popped[i + 1]
    end
  end
end
if polite then pol_flush(DOMS, INFO, now) end

if worker ~= '' then redis.call('ZADD', KEYS[9], now, worker) end
local bloom_n = dupe_close(d)
return {table.concat(flags), leased, requeued, moved, redis.call('ZCARD', Q),
        redis.call('ZCARD', L), redis.call('ZCARD', KEYS[5]), bloom_n, paused}
