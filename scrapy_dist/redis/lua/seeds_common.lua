-- seeds_common: functions shared by the seeds scripts (prepended to seeds_take.lua and seeds_adopt.lua);
-- not a script on its own (no KEYS, ARGV or return value).
--
-- The processing LIST holds every seed a worker popped and has not yet put in the frontier, as
-- '<worker id>\n<entry>' (worker ids hold no newline), where <entry> is the seed as the seeds key held
-- it: the raw seed for a LIST or SET seeds key, '<score> <raw seed>' for a ZSET (so a seed goes back
-- with its score).

local function seeds_now(arg)
  local now = tonumber(arg)
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  end
  return now
end

-- Whether the seeds key can take entries of `kind` ('list', 'set', 'zset'): it has that type or does
-- not exist. Also returns the key's type.
local function seeds_type_ok(seeds, kind)
  local t = redis.call('TYPE', seeds)['ok']
  return (t == 'none' or t == kind), t
end

-- Run `cmd key item...` over `items` in chunks (Lua's unpack has a stack limit).
local function seeds_chunked(cmd, key, items)
  for i = 1, #items, 7000 do
    redis.call(cmd, key, unpack(items, i, math.min(i + 6999, #items)))
  end
end

-- One pass over the processing LIST: takes out and returns (unprefixed, in their order) the entries of the
-- workers in `adopt` (a table id -> true), and, since no worker files such entries, those of no worker
-- registered in `workers` with a deadline up to `horizon`, those without a worker id, and those of one
-- worker past the first `cap` (a worker holds far fewer): garbage someone else wrote there, which every
-- acknowledgement (LREM) and every adoption would otherwise read again, for as long as it stays. Also
-- returns how many entries were taken out that were not the adopted workers'. O(length of the list): only
-- for give-backs, adoptions and a list grown past its bound, never per seed.
local function seeds_pass(processing, workers, adopt, horizon, cap)
  local items = redis.call('LRANGE', processing, 0, -1)
  local keep, out, held, state = {}, {}, {}, {}
  local strays = 0
  for _, e in ipairs(items) do
    local nl = string.find(e, '\n', 1, true)
    local w = nl and string.sub(e, 1, nl - 1)
    local s = w and state[w]
    if w and not s then
      if adopt[w] then s = 'adopt'
      else
        local deadline = tonumber(redis.call('ZSCORE', workers, w))
        s = (deadline and deadline <= horizon) and 'live' or 'stray'
      end
      state[w], held[w] = s, 0
    end
    if s == 'live' and held[w] < cap then
      held[w] = held[w] + 1
      keep[#keep + 1] = e
    else
      if s ~= 'adopt' then strays = strays + 1 end
      out[#out + 1] = nl and string.sub(e, nl + 1) or e
    end
  end
  if #out > 0 then
    redis.call('DEL', processing)
    seeds_chunked('RPUSH', processing, keep)
  end
  return out, strays
end

-- Put `entries` back into the seeds key (a LIST gets them at its head, in their order, so they are taken
-- next). The caller has checked the key's type.
local function seeds_return(seeds, kind, entries)
  if #entries == 0 then return end
  if kind == 'list' then
    local rev = {}
    for i = #entries, 1, -1 do rev[#rev + 1] = entries[i] end
    seeds_chunked('LPUSH', seeds, rev)
  elseif kind == 'set' then
    seeds_chunked('SADD', seeds, entries)
  else
    -- the score as Lua read it, not as written: tonumber takes 'nan', '1e999', ' 5' that ZADD refuses,
    -- and a refused ZADD here comes after seeds_pass rewrote the processing list (seeds lost)
    local args = {}
    for _, e in ipairs(entries) do
      local sp = string.find(e, ' ', 1, true)
      local score = sp and tonumber(string.sub(e, 1, sp - 1))
      if score and score == score then
        args[#args + 1] = string.format('%.17g', score)
        args[#args + 1] = string.sub(e, sp + 1)
      end
    end
    seeds_chunked('ZADD', seeds, args)
  end
end
