-- sync: one worker's whole exchange with the frontier in one atomic call.
-- Requeues expired leases, moves due delayed retries into the queue, dedupes and enqueues discovered
-- requests, acknowledges finished ones, renews/release/rejects leases, writes dead letters and leases
-- new work -- so a batch's new requests and the ack of the request that produced them land together.
--
-- KEYS[1] queue ZSET          KEYS[2] leases ZSET        KEYS[3] lease meta HASH   KEYS[4] seq STRING
-- KEYS[5] delayed ZSET        KEYS[6] delayed meta HASH  KEYS[7] rejected LIST     KEYS[8] deadletter LIST
-- KEYS[9] workers ZSET        KEYS[10] control HASH      KEYS[11..] dupefilter keys (see dupe.lua)
-- ARGV[1] now (unix seconds; '' = server time)   ARGV[2] worker id ('' = a tool, not a worker)
-- ARGV[3] lease seconds
-- ARGV[4] how many requests to lease             ARGV[5] 'asc' (FIFO/priority) or 'desc' (LIFO)
-- ARGV[6] dupe mode   ARGV[7] P   ARGV[8 .. 7+P] dupe params
-- then sections, each a count followed by its items:
--   enqueue: 4 per item: t1, t2 (t1 == '' skips dedupe), score, payload (payload == '' dedupes only)
--   ack:     1 per item: member
--   renew:   1 per item: member
--   release: 1 per item: member            (back to the queue with its original score, now)
--   delay:   3 per item: score, payload, delay in seconds from now (the server's clock decides)
--   reject:  2 per item: member, JSON record (the leased member is dropped, the record pushed)
--   dead:    1 per item: JSON record
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
local P = tonumber(ARGV[7])
local params = {}
for i = 1, P do params[i] = ARGV[7 + i] end
local pos = 8 + P

local d = dupe_open(ARGV[6], 11, params)
local n_enqueue = tonumber(ARGV[pos])
if not dupe_can_insert(d, n_enqueue) then return {-1, d.n} end

local function seq6(s)
  local b = {}
  for i = 6, 1, -1 do b[i] = s % 256; s = math.floor(s / 256) end
  return string.char(b[1], b[2], b[3], b[4], b[5], b[6])
end
local MAXSEQ = 281474976710655  -- 2^48 - 1
local function new_members(count)
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

-- 1. leases of dead workers run out: back to the queue with their original priority
local requeued = 0
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 500)
for _, m in ipairs(expired) do
  local meta = redis.call('HGET', KEYS[3], m)
  local score = meta and string.match(meta, '^(%S+)') or '0'
  redis.call('ZADD', KEYS[1], score, m)
  redis.call('ZREM', KEYS[2], m)
  redis.call('HDEL', KEYS[3], m)
  requeued = requeued + 1
end

-- 2. due delayed retries join the queue
local moved = 0
local due = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, 500)
for _, m in ipairs(due) do
  local score = redis.call('HGET', KEYS[6], m) or '0'
  redis.call('ZADD', KEYS[1], score, m)
  redis.call('ZREM', KEYS[5], m)
  redis.call('HDEL', KEYS[6], m)
  moved = moved + 1
end

-- 3. discovered requests: dedupe, then enqueue the new ones in one ZADD
local flags = {}
local to_add = {}
pos = pos + 1
for i = 1, n_enqueue do
  local t1, t2, score, payload = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2], ARGV[pos + 3]
  pos = pos + 4
  local new = 1
  if t1 ~= '' then new = dupe_add(d, t1, t2) end
  flags[i] = new
  if new == 1 and payload ~= '' then to_add[#to_add + 1] = {score, payload} end
end
if #to_add > 0 then
  local members = new_members(#to_add)
  local args = {}
  for i, e in ipairs(to_add) do
    args[#args + 1] = e[1]; args[#args + 1] = members[i] .. e[2]
  end
  for i = 1, #args, 7998 do
    redis.call('ZADD', KEYS[1], unpack(args, i, math.min(i + 7997, #args)))
  end
end

-- 4. acknowledgements: the work is done and its output is in (step 3, same call)
local n = tonumber(ARGV[pos]); pos = pos + 1
for i = 1, n do
  local m = ARGV[pos]; pos = pos + 1
  redis.call('ZREM', KEYS[2], m)
  redis.call('HDEL', KEYS[3], m)
  redis.call('ZREM', KEYS[1], m)  -- a copy requeued after its lease ran out need not run again
end

-- 5. lease renewals (only leases still held: a lease that already ran out stays requeued)
local deadline = now + lease_s
n = tonumber(ARGV[pos]); pos = pos + 1
for i = 1, n do
  redis.call('ZADD', KEYS[2], 'XX', deadline, ARGV[pos]); pos = pos + 1
end

-- 6. releases: unstarted work given back on shutdown
n = tonumber(ARGV[pos]); pos = pos + 1
for i = 1, n do
  local m = ARGV[pos]; pos = pos + 1
  if redis.call('ZREM', KEYS[2], m) == 1 then
    local meta = redis.call('HGET', KEYS[3], m)
    redis.call('ZADD', KEYS[1], meta and string.match(meta, '^(%S+)') or '0', m)
    redis.call('HDEL', KEYS[3], m)
  end
end

-- 7. delayed retries
n = tonumber(ARGV[pos]); pos = pos + 1
if n > 0 then
  local members = new_members(n)
  for i = 1, n do
    local score, payload, delay = ARGV[pos], ARGV[pos + 1], tonumber(ARGV[pos + 2]); pos = pos + 3
    local m = members[i] .. payload
    redis.call('ZADD', KEYS[5], now + delay, m)
    redis.call('HSET', KEYS[6], m, score)
  end
end

-- 8. rejected entries leave the lease set for the rejected list
n = tonumber(ARGV[pos]); pos = pos + 1
for i = 1, n do
  local m, record = ARGV[pos], ARGV[pos + 1]; pos = pos + 2
  redis.call('ZREM', KEYS[2], m)
  redis.call('HDEL', KEYS[3], m)
  redis.call('RPUSH', KEYS[7], record)
end

-- 9. dead letters
n = tonumber(ARGV[pos]); pos = pos + 1
for i = 1, n do
  redis.call('RPUSH', KEYS[8], ARGV[pos]); pos = pos + 1
end

-- 10. lease new work
local leased = {}
local paused = redis.call('HGET', KEYS[10], 'paused')
if paused == '1' then n_lease = 0 else paused = '0' end
if n_lease > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[1], n_lease)
  for i = 1, #popped, 2 do
    local m, score = popped[i], popped[i + 1]
    redis.call('ZADD', KEYS[2], deadline, m)
    redis.call('HSET', KEYS[3], m, score .. ' ' .. worker)
    leased[#leased + 1] = m; leased[#leased + 1] = score
  end
end

if worker ~= '' then redis.call('ZADD', KEYS[9], now, worker) end
local bloom_n = dupe_close(d)
return {table.concat(flags), leased, requeued, moved, redis.call('ZCARD', KEYS[1]),
        redis.call('ZCARD', KEYS[2]), redis.call('ZCARD', KEYS[5]), bloom_n, paused}
