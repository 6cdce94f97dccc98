-- errors: one worker's error counts of the last interval into the crawl-wide sliding window, the window's
-- totals back, and -- when a threshold is passed -- the crawl-wide action, taken by exactly one caller.
--
-- The window is a HASH of counters per time bucket: field '<bucket>|<name>' where bucket =
-- floor(now / bucket seconds) and name is 'attempts' (responses and download errors), 'errors', 'http',
-- 'download', 'spider' or 'r:<reason>'; fields '_bucket' and '_window' record the geometry for readers.
-- Buckets that left the window are deleted here, so the hash stays small.
--
-- KEYS[1] errors window HASH   KEYS[2] error examples LIST   KEYS[3] control HASH
-- ARGV[1] now (unix seconds; '' = server time)   ARGV[2] bucket seconds   ARGV[3] window seconds
-- ARGV[4] most errors allowed per window ('' = no limit)   ARGV[5] highest error rate allowed ('' = none)
-- ARGV[6] fewest attempts in the window before the rate is judged
-- ARGV[7] action: 'log', 'pause' or 'close'   ARGV[8] how many examples the LIST keeps
-- ARGV[9] N, then N name/count pairs, then JSON example records (newest last)
-- Returns {tripped, now, totals, control, examples, garbage}:
--   tripped   1 if this call passed the threshold first (it took the action: for 'pause' HSET control
--             paused 1, for 'close' HSET control close error_threshold; for 'log' nothing) -- the caller
--             then logs the alert; 0 otherwise. One trip per window: control 'errors_tripped_at' holds it.
--   totals    flat name, count list of the window's sums
--   control   {close reason or '', close_at or '', paused '0'/'1'}
--   examples  the kept example records when tripped, else empty
--   garbage   how many fields of the window no worker writes were deleted (written by someone else)

-- a window, examples list or control hash of another Redis type is someone else's: moved aside, so the
-- crawl-wide monitor goes on (each command below would fail on it)
types_ok(KEYS, {'hash', 'list', 'hash'}, {})

local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local bucket_s = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local keep = tonumber(ARGV[8])
local bucket = math.floor(now / bucket_s)

local n = tonumber(ARGV[9])
local pos = 10
for i = 1, n do
  local count = tonumber(ARGV[pos + 1])
  if count ~= 0 then
    -- a stored counter that is not an integer (garbage) is replaced, not a half-done call
    local ok = redis.pcall('HINCRBY', KEYS[1], bucket .. '|' .. ARGV[pos], count)
    if type(ok) == 'table' and ok.err then redis.call('HSET', KEYS[1], bucket .. '|' .. ARGV[pos], count) end
  end
  pos = pos + 2
end
if n > 0 then  -- a call with nothing to add only reads: it does not bring back a deleted window
  redis.call('HSET', KEYS[1], '_bucket', ARGV[2], '_window', ARGV[3])
  redis.call('EXPIRE', KEYS[1], math.ceil(window * 2 + bucket_s))
end
if pos <= #ARGV then
  redis.call('RPUSH', KEYS[2], unpack(ARGV, pos, #ARGV))
  redis.call('LTRIM', KEYS[2], -keep, -1)
  redis.call('EXPIRE', KEYS[2], 86400)
end

-- sum the window, dropping buckets that have left it, and fields no worker writes: a bucket ahead of now
-- (it would never leave the window, and trip the monitor again after every resume), a count that is not
-- a whole number HINCRBY could have made, any other name -- each read again by every call while it stayed
local totals = {}
local order = {}
local stale = {}
local garbage = 0
local flat = redis.call('HGETALL', KEYS[1])
for i = 1, #flat, 2 do
  local f = flat[i]
  local b, name = string.match(f, '^(%d+)|(.+)$')
  local count = b and string.match(flat[i + 1], '^%d+$') and #flat[i + 1] <= 15 and tonumber(flat[i + 1])
  if b and count and tonumber(b) <= bucket + 1 then  -- one bucket of leeway: callers may pass their clock
    if (tonumber(b) + 1) * bucket_s <= now - window then
      stale[#stale + 1] = f
    else
      if not totals[name] then totals[name] = 0; order[#order + 1] = name end
      totals[name] = totals[name] + count
    end
  elseif f ~= '_bucket' and f ~= '_window' then
    stale[#stale + 1] = f
    garbage = garbage + 1
  end
end
for i = 1, #stale, 500 do
  redis.call('HDEL', KEYS[1], unpack(stale, i, math.min(i + 499, #stale)))
end

local errors = totals['errors'] or 0
local attempts = totals['attempts'] or 0
local over = false
if ARGV[4] ~= '' and errors > tonumber(ARGV[4]) then over = true end
if ARGV[5] ~= '' and attempts >= tonumber(ARGV[6]) and attempts > 0
   and errors / attempts > tonumber(ARGV[5]) then over = true end

local action = ARGV[7]
local tripped = 0
local examples = {}
local paused = redis.call('HGET', KEYS[3], 'paused')
if over then
  local last = tonumber(redis.call('HGET', KEYS[3], 'errors_tripped_at') or '')
  if not last or now - last >= window then
    if not (action == 'pause' and paused == '1') then
      tripped = 1
      local now_s = string.format('%.6f', now)
      redis.call('HSET', KEYS[3], 'errors_tripped_at', now_s)
      if action == 'pause' then
        redis.call('HSET', KEYS[3], 'paused', '1', 'paused_by', 'errormonitor', 'paused_at', now_s)
        paused = '1'
      elseif action == 'close' then
        redis.call('HSET', KEYS[3], 'close', 'error_threshold', 'close_at', now_s)
      end
      examples = redis.call('LRANGE', KEYS[2], -keep, -1)  -- pushed by someone else, it may hold more
    end
  end
end

local out = {}
for _, name in ipairs(order) do out[#out + 1] = name; out[#out + 1] = tostring(totals[name]) end
local control = redis.call('HMGET', KEYS[3], 'close', 'close_at')
return {tripped, string.format('%.6f', now), out,
        {control[1] or '', control[2] or '', paused == '1' and '1' or '0'}, examples, garbage}
