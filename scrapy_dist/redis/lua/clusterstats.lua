-- clusterstats: one worker's periodic flush -- its heartbeat and the changes of its Scrapy stats since the
-- last flush, merged into the crawl-wide stats hash -- in one atomic call.
--
-- KEYS[1] crawl-wide stats HASH   KEYS[2] workers ZSET (id -> last seen)   KEYS[3] this worker's HASH
-- KEYS[4] (optional) the crawl's history STREAM: one sample per flush, entries older than HISTORY_SECONDS
--         dropped, never more than about HISTORY_MAXLEN (see docs/monitoring.md for its memory)
-- ARGV[1] worker id   ARGV[2] flush sequence number (1, 2, ...; the number last applied is not applied
--         again, so a flush resent after a lost reply counts once)   ARGV[3] TTL of the worker hash (seconds)
-- ARGV[4] '1' for the last flush of a closing worker, else '0'
-- ARGV[5] H, then H field/value pairs for the worker hash
-- then merge operations, 3 items each: mode, stat name, value, where mode is
--   'sum' (add the value: HINCRBY, or HINCRBYFLOAT for non-integers), 'max' / 'min' (keep the larger /
--   smaller of stored and given value: numerically if both are numbers, else as strings -- timestamps are
--   fixed-width ISO 8601 UTC, so they compare as strings), 'set' (store the value).
-- Returns {applied, server time, garbage}: garbage is 1 when the worker hash's flush_seq held a value this
-- worker did not write there (repaired), else 0; applied is 1 when the stats were merged, 0 when this sequence number
-- had been applied already, -1 when nothing was written because the crawl's keys are gone (the last
-- flush of a worker of a non-persistent crawl that has finished and removed them).

-- keys of another Redis type are someone else's: moved aside, so the crawl-wide stats, the heartbeat and
-- the history go on
types_ok(KEYS, {'hash', 'zset', 'hash', 'stream'}, {})

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local now_s = string.format('%.6f', now)

if ARGV[4] == '1' and redis.call('EXISTS', KEYS[1]) == 0 and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[3])
  return {-1, now_s, 0}
end

local h = tonumber(ARGV[5])
local pos = 6
local fields = {'last_seen', now_s}
for i = 1, h do
  fields[#fields + 1] = ARGV[pos]; fields[#fields + 1] = ARGV[pos + 1]
  pos = pos + 2
end
local applied = 0
local seq = tonumber(ARGV[2])
-- Only the last number applied is skipped: a worker resends its last flush or sends the next one, so
-- any other stored value (not a number, or past what it sends: 1e308, inf) is garbage someone wrote,
-- which must not silence the worker's stats: the flush is applied and the field repaired.
local stored = redis.call('HGET', KEYS[3], 'flush_seq')
local done = tonumber(stored or '0') or 0
local garbage = (stored and not (tonumber(stored) and (done == seq or done == seq - 1))) and 1 or 0
if seq ~= done then
  applied = 1
  fields[#fields + 1] = 'flush_seq'; fields[#fields + 1] = ARGV[2]
  while pos + 2 <= #ARGV do
    local mode, name, value = ARGV[pos], ARGV[pos + 1], ARGV[pos + 2]
    pos = pos + 3
    if mode == 'sum' then
      -- Scripts validate before they write: an increment Redis would refuse (a stored value that is not
      -- a number) must not stop the call half way, so a refused increment stores the value instead.
      local x = tonumber(value)
      if x and x == x and x ~= math.huge and x ~= -math.huge then
        local ok = redis.pcall('HINCRBY', KEYS[1], name, value)
        if type(ok) == 'table' and ok.err then
          -- a float value, or the stored value is a float already (the stat changed type)
          ok = redis.pcall('HINCRBYFLOAT', KEYS[1], name, value)
          if type(ok) == 'table' and ok.err then redis.call('HSET', KEYS[1], name, value) end
        end
      end
    elseif mode == 'max' or mode == 'min' then
      local cur = redis.call('HGET', KEYS[1], name)
      local replace = not cur
      if cur then
        local a, b = tonumber(value), tonumber(cur)
        if not (a and b) then a, b = value, cur end
        if mode == 'max' then replace = a > b else replace = a < b end
      end
      if replace then redis.call('HSET', KEYS[1], name, value) end
    elseif mode == 'set' then
      redis.call('HSET', KEYS[1], name, value)
    end
  end
end
redis.call('HSET', KEYS[3], unpack(fields))
redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
redis.call('ZADD', KEYS[2], now, ARGV[1])

-- the history sample (a history key of another type was moved aside above)
local HISTORY_SECONDS, HISTORY_MAXLEN = 3600, 20000
if KEYS[4] then
  local f = {}
  for i = 1, #fields, 2 do f[fields[i]] = fields[i + 1] end
  local minid = string.format('%d', math.floor((now - HISTORY_SECONDS) * 1000))
  redis.call('XADD', KEYS[4], 'MINID', '~', minid, '*',
             'w', ARGV[1], 'p', f.pages or '', 'i', f.items or '', 'e', f.errors or '',
             'P', redis.call('HGET', KEYS[1], 'response_received_count') or '0',
             'I', redis.call('HGET', KEYS[1], 'item_scraped_count') or '0',
             'q', f.frontier_queued or '', 'f', f.frontier_inflight or '', 'd', f.frontier_delayed or '')
  if redis.call('XLEN', KEYS[4]) > HISTORY_MAXLEN then
    redis.call('XTRIM', KEYS[4], 'MAXLEN', '~', HISTORY_MAXLEN)
  end
end
return {applied, now_s, garbage}
