-- seeds_take: one worker's exchange with the seeds key, in one atomic call: acknowledge the seeds that
-- are now in the frontier, renew its lease, give back what it asks to, take new seeds -- popped and
-- recorded in the processing list in the same step, so a worker killed right after loses nothing: its
-- entries go back to the seeds key once its lease runs out -- and name the workers whose lease ran out.
--
-- KEYS[1] seeds key (LIST, SET or ZSET)
-- KEYS[2] processing LIST: '<worker id>\n<entry>' per seed popped and not yet in the frontier
-- KEYS[3] workers ZSET: worker id -> lease deadline (unix seconds)
-- ARGV[1] now (unix seconds; '' = server time)   ARGV[2] worker id (no newline)   ARGV[3] lease seconds
-- ARGV[4] kind of the seeds key: 'list', 'set' or 'zset'        ARGV[5] how many seeds to take
-- ARGV[6] mode: 'take'; 'sweep' (first give back every entry of this worker left after the acks: the
--         worker knows of none, e.g. a reply was lost); 'leave' (sweep, take nothing, drop the worker)
-- ARGV[7] '1' if the worker registered itself before: a missing ZSET entry then means another worker
--         adopted its entries (status 'lost')
-- ARGV[8] how many expired workers to report at most
-- ARGV[9] horizon (seconds): a worker deadline further ahead than now + this is garbage, not a lease
-- ARGV[10] cap: most entries one worker may hold (see seeds_pass); a list longer than cap x (workers + 1)
--         is tidied in this call
-- ARGV[11..] acknowledged entries (as taken, without the worker prefix), each removed once
-- Returns {status, taken, expired, returned, type, repaired, strays}:
--   status   'ok', 'lost', or 'wrongtype' (KEYS[1] holds another type: nothing taken or given back)
--   taken    the entries taken, without the worker prefix
--   expired  ids of other workers whose lease ran out, or whose deadline is garbage (adopt them with
--            seeds_adopt)
--   returned how many of this worker's entries went back to KEYS[1]
--   type     the type of KEYS[1]
--   repaired KEYS[2] and/or KEYS[3] if they held another Redis type (moved aside, see foreign.lua)
--   strays   how many entries of no live worker went back to KEYS[1] too (garbage, see seeds_pass)

local now = seeds_now(ARGV[1])
local worker = ARGV[2]
local prefix = worker .. '\n'
local lease_s = tonumber(ARGV[3])
local kind = ARGV[4]
local count = tonumber(ARGV[5])
local mode = ARGV[6]
local horizon = now + tonumber(ARGV[9])
local cap = tonumber(ARGV[10])

-- Before the first write: a processing LIST or workers ZSET of another type would make the RPUSH of
-- popped seeds fail after the pop (seeds lost), and refusing them would stop every worker's seeds.
local repaired = {}
types_ok({KEYS[2], KEYS[3]}, {'list', 'zset'}, repaired)

local status = 'ok'
if ARGV[7] == '1' and not redis.call('ZSCORE', KEYS[3], worker) then status = 'lost' end

for i = 11, #ARGV do
  redis.call('LREM', KEYS[2], 1, prefix .. ARGV[i])
end

local ok, key_type = seeds_type_ok(KEYS[1], kind)
local returned, strays = 0, 0
local taken = {}
if not ok then
  status = 'wrongtype'
  redis.call('ZADD', KEYS[3], now + lease_s, worker)
else
  local out = {}
  if mode ~= 'take' then
    out, strays = seeds_pass(KEYS[2], KEYS[3], {[worker] = true}, horizon, cap)
  elseif redis.call('LLEN', KEYS[2]) > cap * (redis.call('ZCARD', KEYS[3]) + 1) then
    out, strays = seeds_pass(KEYS[2], KEYS[3], {}, horizon, cap)
  end
  seeds_return(KEYS[1], kind, out)
  returned = #out - strays
  if mode == 'leave' then
    redis.call('ZREM', KEYS[3], worker)
  else
    redis.call('ZADD', KEYS[3], now + lease_s, worker)
  end
  if count > 0 and mode ~= 'leave' then
    if kind == 'list' then
      taken = redis.call('LPOP', KEYS[1], count) or {}
    elseif kind == 'set' then
      taken = redis.call('SPOP', KEYS[1], count)
    else
      local flat = redis.call('ZPOPMAX', KEYS[1], count)
      for i = 1, #flat, 2 do taken[#taken + 1] = flat[i + 1] .. ' ' .. flat[i] end
    end
    local held = {}
    for i, e in ipairs(taken) do held[i] = prefix .. e end
    seeds_chunked('RPUSH', KEYS[2], held)
  end
end

local expired = {}
local limit = tonumber(ARGV[8])
if limit > 0 then
  local rows = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. string.format('%.6f', now),
                          'LIMIT', 0, limit + 1)
  -- a deadline past the horizon (1e300, inf) never runs out: its worker's entries would stay for ever
  local far = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. string.format('%.6f', horizon), '+inf', 'LIMIT', 0,
                         limit)
  for _, w in ipairs(far) do rows[#rows + 1] = w end
  for _, w in ipairs(rows) do
    if w ~= worker and #expired < limit then expired[#expired + 1] = w end
  end
end

return {status, taken, expired, returned, key_type, repaired, strays}
