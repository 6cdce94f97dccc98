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

-- Remove every entry of `prefix` ('<worker id>\n') from the processing LIST; returns them, unprefixed,
-- in their order. O(length of the list): only for give-backs and adoptions, never per seed.
local function seeds_extract(processing, prefix)
  local items = redis.call('LRANGE', processing, 0, -1)
  local keep, mine = {}, {}
  local n = #prefix
  for _, e in ipairs(items) do
    if string.sub(e, 1, n) == prefix then mine[#mine + 1] = string.sub(e, n + 1)
    else keep[#keep + 1] = e end
  end
  if #mine > 0 then
    redis.call('DEL', processing)
    seeds_chunked('RPUSH', processing, keep)
  end
  return mine
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
    -- and a refused ZADD here comes after seeds_extract rewrote the processing list (seeds lost)
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
