-- sync: one worker's whole exchange with the frontier in one atomic call.
-- Requeues expired leases, moves due delayed retries into the queue, dedupes and enqueues discovered
-- requests, acknowledges finished ones, renews/releases/rejects leases, writes dead letters and leases
-- new work -- so a batch's new requests and the ack of the request that produced them land together.
--
-- KEYS[1] queue ZSET          KEYS[2] leases ZSET        KEYS[3] lease meta HASH   KEYS[4] seq STRING
-- KEYS[5] delayed ZSET        KEYS[6] delayed meta HASH  KEYS[7] rejected LIST     KEYS[8] deadletter LIST
-- KEYS[9] workers ZSET        KEYS[10] control HASH      KEYS[11] domains ZSET     KEYS[12] domain info HASH
-- KEYS[13] queue tails HASH (score -> the chunk still open for appends)   KEYS[14..] dupefilter keys (dupe.lua)
-- Sharded frontier: every KEYS of one call are one shard's (one hash slot). For a shard > 0, KEYS[8..12]
-- are that shard's names of crawl-wide keys, which stay empty: the scheduler sends dead letters only with
-- shard 0, its pause flag is set only on shard 0, and cluster politeness is refused with shards.
--
-- Queue members. A *single* is <6-byte seq><payload> (payloads start with version byte 0x01); that is
-- also what a lease holds and what anyone may ZADD. With 'asc' order and no politeness, this script
-- packs new entries of one score into *chunks*: <6-byte seq of the first record>\0 then records
-- <2-byte length><6-byte seq><payload>, up to CHUNK_RECORDS per chunk. A chunk costs the sorted set's
-- per-member overhead (~100 bytes) once for many requests, which is most of a single's memory.
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
-- then, optionally, '0' = this call is for a shard > 0 of a sharded frontier (SCHEDULER_SHARDS): the
--   worker's heartbeat (KEYS[9]) is written by its shard-0 call only; absent or anything else = write it
-- Returns {flags, leased, requeued, moved, queued, inflight, delayed, bloom_n, paused, seq} where flags has
-- one '1'/'0' per enqueue item (new/duplicate), leased is a flat list member, score, member, score... and
-- seq is the sequence counter (it grows with every entry created, so two equal readings with nothing
-- queued, leased or delayed in between prove the shard stayed empty)
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
local Q, L, LM, DOMS, INFO, TAILS = KEYS[1], KEYS[2], KEYS[3], KEYS[11], KEYS[12], KEYS[13]
local chunked = order == 'asc' and not polite
local CHUNK_RECORDS = 16

local d = dupe_open(ARGV[8], 14, params)
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
-- requests in the queue (chunks hold several, so ZCARD undercounts): TAILS field 'count'
local queued_delta = 0
-- a member goes (back) into the queue
local function to_queue(m, score)
  redis.call('ZADD', Q, score, m)
  queued_delta = queued_delta + 1
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

local function u16(n) return string.char(math.floor(n / 256), n % 256) end

-- Append singles (seq .. payload strings) of one score to that score's open chunk, opening new ones.
local function append_chunked(score, singles)
  local tail = redis.call('HGET', TAILS, score)
  local records, count, head = {}, 0, nil
  if tail and redis.call('ZSCORE', Q, tail) then
    redis.call('ZREM', Q, tail)
    head = tail
    -- count the records already in the tail chunk
    local p = 8
    while p + 1 <= #tail do
      local len = string.byte(tail, p) * 256 + string.byte(tail, p + 1)
      p = p + 2 + len
      count = count + 1
    end
  end
  local function close()
    if head then redis.call('ZADD', Q, score, head .. table.concat(records)) end
  end
  for _, single in ipairs(singles) do
    if not head or count >= CHUNK_RECORDS then
      close()
      head, records, count = string.sub(single, 1, 6) .. '\0', {}, 0
    end
    records[#records + 1] = u16(#single - 6) .. single
    count = count + 1
  end
  close()
  redis.call('HSET', TAILS, score, head .. table.concat(records))
end

-- Split a queue member into singles (a single is itself). Malformed chunks yield their rest as one
-- bogus single, which the worker rejects with a reason.
local function singles_of(member)
  if #member < 7 or string.byte(member, 7) ~= 0 then return {member} end
  local out, p = {}, 8
  while p <= #member do
    if p + 1 > #member then out[#out + 1] = string.sub(member, p); break end
    local len = string.byte(member, p) * 256 + string.byte(member, p + 1)
    if p + 2 + 6 + len - 1 > #member then out[#out + 1] = string.sub(member, p); break end
    out[#out + 1] = string.sub(member, p + 2, p + 2 + 6 + len - 1)
    p = p + 2 + 6 + len
  end
  return out
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
if #to_add > 0 and chunked then
  local seqs = new_seqs(#to_add)
  local by_score, scores = {}, {}
  for i, p in ipairs(to_add) do
    local score = ARGV[p + 2]
    if not by_score[score] then by_score[score] = {}; scores[#scores + 1] = score end
    local group = by_score[score]
    group[#group + 1] = seqs[i] .. ARGV[p + 3]
  end
  for _, score in ipairs(scores) do append_chunked(score, by_score[score]) end
  queued_delta = queued_delta + #to_add
elseif #to_add > 0 then
  queued_delta = queued_delta + #to_add
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
  if redis.call('ZREM', Q, m) == 1 then
    queued_delta = queued_delta - 1
    if polite then pol_count(INFO, pol_domain(m), -1, 0) end
  end
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
local heartbeat = ARGV[pos] ~= '0'

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
    local got = 0
    while got < n_lease do
      local popped = redis.call('ZPOPMIN', Q, 1)
      if #popped == 0 then break end
      local member, score = popped[1], popped[2]
      local singles = singles_of(member)
      local keep = math.min(#singles, n_lease - got)
      for i = 1, keep do
        take(singles[i], score)
        leased[#leased + 1] = singles[i]; leased[#leased + 1] = score
      end
      got = got + keep
      if keep < #singles then
        -- the rest goes back as a chunk headed by its first record's seq (same place in the order)
        local rest = {}
        for i = keep + 1, #singles do rest[#rest + 1] = u16(#singles[i] - 6) .. singles[i] end
        local left = string.sub(singles[keep + 1], 1, 6) .. '\0' .. table.concat(rest)
        redis.call('ZADD', Q, score, left)
        if redis.call('HGET', TAILS, score) == member then redis.call('HSET', TAILS, score, left) end
      end
    end
  end
end
if polite then pol_flush(DOMS, INFO, now) end
queued_delta = queued_delta - #leased / 2
local members_left = redis.call('ZCARD', Q)
local queued = 0
if members_left > 0 then
  queued = redis.call('HINCRBY', TAILS, 'count', queued_delta)
  if queued < members_left then
    queued = members_left  -- written by someone else than this script: heal the counter
    redis.call('HSET', TAILS, 'count', queued)
  end
else
  redis.call('HSET', TAILS, 'count', 0)
end

if worker ~= '' and heartbeat then redis.call('ZADD', KEYS[9], now, worker) end
local bloom_n = dupe_close(d)
return {table.concat(flags), leased, requeued, moved, queued,
        redis.call('ZCARD', L), redis.call('ZCARD', KEYS[5]), bloom_n, paused,
        redis.call('GET', KEYS[4]) or '0'}
